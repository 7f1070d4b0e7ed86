"""bench/reports/layer_ab.py on synthetic bench_layer passes: the lowest pass per side, the per-pass
ratios, the dW ratio, and the per-GEMM stage table with one expert's W1 bytes."""
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "reports" / "layer_ab.py"
STAGES = ("fwd.up_proj", "fwd.down_proj", "bwd.dA_proj", "bwd.dX_proj", "bwd.dW1", "bwd.dW2")


def bench_pass(path, total, up):
    cfg = {"name": "c1", "T": 1024, "d": 512, "n": 256, "E": 8, "K": 2}
    kernels = {s + "_ms": 1.0 for s in STAGES}
    kernels["fwd.up_proj_ms"] = up
    path.write_text(json.dumps({"results": [
        {"config": cfg, "systems": {"ours": {"fwd_ms": total / 3, "bwd_ms": 2 * total / 3}}, "kernels": kernels},
        {"config": {"name": "broken"}, "systems": {"ours": {"error": "x"}}, "kernels": {}}]}))
    return str(path)


def test_tables_and_json(tmp_path):
    a = [bench_pass(tmp_path / "a1.json", 3.0, 1.2), bench_pass(tmp_path / "a2.json", 3.3, 1.0)]
    b = [bench_pass(tmp_path / "b1.json", 2.5, 0.8), bench_pass(tmp_path / "b2.json", 2.7, 0.9)]
    out, md = tmp_path / "ab.json", tmp_path / "ab.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", "old=" + ",".join(a), "--b", "new=" + ",".join(b),
                        "--out", str(out), "--md", str(md)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]  # the config that could not run is left out
    assert abs(row["speedup"] - 3.0 / 2.5) < 1e-9
    assert [round(x, 6) for x in row["per_pass"]] == [round(3.0 / 2.5, 6), round(3.3 / 2.7, 6)]
    assert abs(row["dw_ratio"] - 1.0) < 1e-9
    assert abs(row["w1_mib"] - 2 * 256 * 512 * 2 / 2**20) < 1e-9
    text = md.read_text()
    assert "| config | W1 MiB | up_proj | down_proj | dA_proj | dX_proj | dW1 | dW2 |" in text
    assert "| c1 | 0.5 | 1.25 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |" in text  # up: 1.0 / 0.8


def test_same_names_refused(tmp_path):
    a = bench_pass(tmp_path / "a.json", 3.0, 1.0)
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", "x=" + a, "--b", "x=" + a], capture_output=True, text=True)
    assert r.returncode != 0 and "different names" in r.stderr


def test_odd_and_even_rounds_split(tmp_path):
    # up-proj: b gains 1.25x in the odd rounds and nothing in the even ones (a side's position moved
    # it); every other stage equal: 1 of 6 stage ratios differs between the halves.
    ups_a, ups_b = (1.0, 1.0, 1.1, 1.05), (0.8, 1.0, 0.85, 1.0)
    a = [bench_pass(tmp_path / f"a{i}.json", 3.0, u) for i, u in enumerate(ups_a)]
    b = [bench_pass(tmp_path / f"b{i}.json", 3.0, u) for i, u in enumerate(ups_b)]
    out, md = tmp_path / "ab.json", tmp_path / "ab.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", "old=" + ",".join(a), "--b", "new=" + ",".join(b),
                        "--out", str(out), "--md", str(md)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert [round(x, 6) for x in row["stages_odd_even"]["fwd.up_proj"]] == [1.25, 1.0]
    assert row["stages_odd_even"]["bwd.dW1"] == [1.0, 1.0]
    text = md.read_text()
    assert "1 of 6 stage ratios differ by more than 3% between the halves" in text
    assert "| c1 | 1.25 / 1.00 | 1.00 / 1.00 |" in text


def test_one_round_has_no_split(tmp_path):
    a = [bench_pass(tmp_path / "a.json", 3.0, 1.0)]
    b = [bench_pass(tmp_path / "b.json", 3.0, 1.0)]
    out, md = tmp_path / "ab.json", tmp_path / "ab.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", "old=" + ",".join(a), "--b", "new=" + ",".join(b),
                        "--out", str(out), "--md", str(md)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["rows"][0]["stages_odd_even"] == {}
    assert "odd rounds / even rounds" not in md.read_text()
