"""CPU test of bench/reports/memory_stages.py: TB/s and % of the copy rate for the least bytes a stage
moves, and the --before columns from a layer_ab.py JSON.
    python3 -m pytest -q tests/python/test_memory_stages.py
"""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reports", "memory_stages.py")


def run(tmp_path, runs, before=None, copy="3.0"):
    files = []
    for i, doc in enumerate(runs):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(doc))
        files.append(str(p))
    args = [sys.executable, SCRIPT, "--copy-tbs", copy]
    if before is not None:
        b = tmp_path / "ab.json"
        b.write_text(json.dumps(before))
        args += ["--before", str(b)]
    return subprocess.run(args + files, check=True, capture_output=True, text=True).stdout


def layer(ms_agg, ms_dx):
    # T * K * d * 2 + T * d * 2 = 1000 * 2 * 1024 * 2 + 1000 * 1024 * 2 = 6.144 MB per stage
    cfg = {"name": "c", "T": 1000, "d": 1024, "E": 8, "K": 2}
    return {"commit": "new", "results": [{"config": cfg, "kernels": {
        "fwd.aggregate_ms": ms_agg, "bwd.dx_sum_ms": ms_dx, "fwd.router_gemm_ms": 0.01, "fwd.routing_ms": 0.01}}]}


def test_lowest_of_runs_and_percent_of_copy(tmp_path):
    out = run(tmp_path, [layer(0.004096, 0.008192), layer(0.003072, 0.009)])
    row = [l for l in out.splitlines() if l.startswith("| c |")][0]
    # aggregate: lowest 0.003072 ms -> 6.144e6 / 3.072e-6 = 2.0 TB/s = 67% of 3.0; dx: 0.008192 -> 0.75 TB/s
    assert "0.003 ms, 2.00 (67%)" in row
    assert "0.008 ms, 0.75 (25%)" in row


def test_before_columns(tmp_path):
    ab = {"a": "old", "b": "mid", "rows": [{"config": "c", "stages": {
        "fwd.aggregate": {"old": 1.0, "mid": 0.006144}, "bwd.dx_sum": {"mid": 0.004096}}}]}
    out = run(tmp_path, [layer(0.003072, 0.004096)], before=ab)
    assert "aggregate at mid" in out and "dx_sum at mid" in out
    row = [l for l in out.splitlines() if l.startswith("| c |")][0]
    assert "0.006 ms (33%), now x2.00" in row  # 6.144e6 / 6.144e-6 = 1.0 TB/s = 33%
    assert "0.004 ms (50%), now x1.00" in row
    # the commit picked explicitly
    out = subprocess.run([sys.executable, SCRIPT, "--copy-tbs", "3.0", "--before", str(tmp_path / "ab.json"),
                          "--before-commit", "old", str(tmp_path / "run0.json")],
                         check=True, capture_output=True, text=True).stdout
    row = [l for l in out.splitlines() if l.startswith("| c |")][0]
    assert "now x325.52" in row and row.count("now x") == 1  # old has no dx_sum stage: '-'
