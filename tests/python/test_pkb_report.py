"""CPU test of bench/reports/pkb_report.py (issue 12's scaling report) on synthetic bench/drivers/pkb_ep.py runs:
Fast@p counts only correct, timed tasks over all timed ones; tables per world size; the plot.
    python3 -m pytest -q tests/python/test_pkb_report.py
"""
import importlib.util
import json
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "pkb_report", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reports", "pkb_report.py"))
rep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rep)


def task(cfg, routing, name, ours, ref, correct=True, R=2, **kw):
    t = {"config": cfg, "routing": routing, "task": name, "T_per_rank": 1024, "world_size": R, "correct": correct}
    if ours is not None:
        t["ours_ms"] = ours
        t["roofline_ms"] = ours / 2
        t["roofline_fraction"] = 0.5
    if ref is not None:
        t["ref_ms"] = ref
    t.update(kw)
    return t


def run(R, scaling, tasks, commit="abc1234"):
    return {"gpu": "NVIDIA H200", "world_size": R, "scaling": scaling, "commit": commit, "nccl": "2.28.9",
            "torch": "2.11.0", "seeds": 3, "tasks": tasks}


def test_fast_at_p_counts_only_correct_timed_tasks():
    tasks = [task("A", "balanced", "layer_fwd", 1.0, 3.0),            # 3x
             task("A", "balanced", "layer_bwd", 1.0, 1.2),            # 1.2x
             task("A", "skewed", "layer_fwd", 1.0, 0.8),              # slower
             task("A", "skewed", "layer_bwd", 1.0, 2.5, correct=False),  # fast but wrong: not counted
             task("A", "skewed", "dispatch_combine", None, None, error="OOM")]  # untimed: not in the base
    f = rep.fast_at_p(tasks)
    assert f == {"1": 0.5, "1.5": 0.25, "2": 0.25}
    assert rep.fast_at_p([]) == {"1": None, "1.5": None, "2": None}


def test_report_merges_world_sizes_and_writes_table_json_plot(tmp_path):
    paths = []
    for R in (1, 2, 4):
        tasks = []
        for cfg in ("OLMoE-7B", "Qwen3-235B"):
            tasks += [task(cfg, "balanced", "layer_fwd", 2.0 / R, 4.0 / R, R=R),
                      task(cfg, "balanced", "layer_bwd", 4.0 / R, 6.0 / R, R=R),
                      task(cfg, "balanced", "dispatch_combine", 0.1 * R, 0.5 * R, R=R)]
        tasks.append(task("OLMoE-7B", "skewed", "layer_fwd", 1.0, 0.9, correct=(R != 4), R=R))
        p = tmp_path / f"pkb_{R}.json"
        p.write_text(json.dumps(run(R, "strong", tasks)))
        paths.append(str(p))
    p = tmp_path / "pkb_weak_2.json"
    p.write_text(json.dumps(run(2, "weak", [task("OLMoE-7B", "balanced", "layer_fwd", 1.0, 2.0)])))
    paths.append(str(p))
    out, _plotted = rep.main(paths + ["--out", str(tmp_path / "scaling"), "--device", "test"])
    j = json.loads((tmp_path / "scaling.json").read_text())
    assert [(r["scaling"], r["world_size"]) for r in j["runs"]] == [("strong", 1), ("strong", 2), ("strong", 4), ("weak", 2)]
    # Per run: 6 fast tasks + 1 slower skewed one (wrong at R = 4): Fast@1 = 6/7 everywhere.
    assert abs(j["runs"][2]["fast_at_p"]["1"] - 6 / 7) < 1e-12 and j["runs"][2]["correct_tasks"] == "6/7"
    olmoe_fwd = next(r for r in j["results"] if r["scaling"] == "strong" and r["config"] == "OLMoE-7B"
                     and r["routing"] == "balanced" and r["task"] == "layer_fwd")
    assert sorted(olmoe_fwd["by_world_size"]) == ["1", "2", "4"]
    assert olmoe_fwd["by_world_size"]["4"]["ours_ms"] == 0.5
    md = (tmp_path / "scaling.md").read_text()
    assert "| strong | 4 | 86% |" in md and "## weak scaling" in md and "WRONG" in md
    assert "| OLMoE-7B | balanced | layer_fwd | 2.00 / 4.00 (2.00x), 50% | 1.00 / 2.00 (2.00x), 50% |" in md
    if _plotted:
        assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_rejects_files_that_are_not_pkb_runs(tmp_path):
    p = tmp_path / "other.json"
    p.write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="not a bench/drivers/pkb_ep.py result"):
        rep.main([str(p), "--out", str(tmp_path / "x")])
