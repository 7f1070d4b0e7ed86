"""bench/reports/gemm_floors.py: FLOPs and compulsory bytes per GEMM stage, the floor that binds, the
lowest median over runs."""
import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reports" / "gemm_floors.py"
spec = importlib.util.spec_from_file_location("gemm_floors", SCRIPT)
gf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gf)

CFG = {"name": "t", "T": 1000, "d": 512, "n": 256, "E": 8, "K": 2}


def test_flops_and_bytes():
    fb = gf.stage_flops_bytes(CFG)
    R = 2000
    assert fb["fwd.up_proj"][0] == 2 * R * 512 * 512
    assert fb["fwd.down_proj"][0] == 2 * R * 256 * 512
    assert fb["bwd.dX_proj"][0] == fb["fwd.up_proj"][0]
    assert fb["bwd.dA_proj"][0] == fb["fwd.down_proj"][0]
    x, w1, w2 = 1000 * 512 * 2, 8 * 512 * 512 * 2, 8 * 256 * 512 * 2
    h, a, y = R * 512 * 2, R * 256 * 2, R * 512 * 2
    assert fb["fwd.up_proj"][1] == x + w1 + h + a
    assert fb["bwd.dA_proj"][1] == x + w2 + 2 * h + a
    assert fb["bwd.dX_proj"][1] == h + w1 + y
    assert fb["bwd.dW1"][1] == x + h + w1


def test_binding_floor():
    fl, nb = gf.stage_flops_bytes(CFG)["fwd.up_proj"]
    compute_ms = fl / 100e12 * 1e3
    bytes_ms = nb / 1e12 * 1e3
    # A slow device (100 TFLOP/s, 1 TB/s): measured at exactly the larger floor -> 100%.
    ms = max(compute_ms, bytes_ms)
    out = gf.floors(CFG, {"fwd.up_proj": ms}, 100, 1)["fwd.up_proj"]
    assert abs(out["of_floor"] - 1) < 1e-12
    assert out["bound"] == ("bytes" if bytes_ms > compute_ms else "compute")
    fast_mem = gf.floors(CFG, {"fwd.up_proj": 1.0}, 100, 1e6)["fwd.up_proj"]
    assert fast_mem["bound"] == "compute"
    fast_math = gf.floors(CFG, {"fwd.up_proj": 1.0}, 1e9, 1)["fwd.up_proj"]
    assert fast_math["bound"] == "bytes"
    assert gf.floors(CFG, {}, 100, 1) == {}


def test_lowest_over_runs_and_cli(tmp_path):
    def run(ms, commit):
        return {"commit": commit, "results": [{"config": CFG, "kernels": {
            "fwd.up_proj_ms": ms, "bwd.dW2_ms": 2 * ms, "fwd.aggregate_ms": 9.0}}]}
    p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
    p1.write_text(json.dumps(run(0.5, "c1")))
    p2.write_text(json.dumps(run(0.4, "c1")))
    best, commits = gf.best_stage_ms([str(p1), str(p2)])
    assert commits == ["c1"]
    assert best["t"][1] == {"fwd.up_proj": 0.4, "bwd.dW2": 0.8}
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--peak-tflops", "700", "--copy-tbs", "4", str(p1), str(p2),
                        "--json", str(out)], capture_output=True, text=True, check=True)
    assert "| t | 0.400 ms" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["rows"]["t"]["fwd.up_proj"]["ms"] == 0.4
    assert "bwd.dA_proj" not in doc["rows"]["t"]
