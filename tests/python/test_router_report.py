"""bench/reports/router_report.py on a results file shaped as router_gemm_bench writes it."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "reports"))
import router_report  # noqa: E402


def doc():
    def lt(i, ms, tile):
        return {"name": f"lt heuristic #{i}", "ms": ms, "tbs": 0.2 / ms, "rel_l2": 1e-7, "algo_id": 66,
                "tile_id": tile, "stages_id": 9, "split_k": 1, "reduction": 0, "swizzle": 0, "waves": 1.5}
    return {"device": "GPU", "commit": "abc", "reps": 20, "warmup": 3, "shapes": [
        {"T": 100, "d": 64, "E": 8, "bytes": 1.0, "copy_ms": 0.1, "copy_tbs": 2.0, "variants": [
            {"name": "gemmex (the layer's)", "ms": 0.4, "tbs": 0.5, "rel_l2": 1e-7}, lt(0, 0.3, 20), lt(1, 0.2, 24)]},
        {"T": 50, "d": 64, "E": 4, "bytes": 1.0, "copy_ms": 0.1, "copy_tbs": 2.0, "variants": [
            {"name": "gemmex (the layer's)", "ms": 0.1, "tbs": 1.0, "rel_l2": None}]},
    ]}


def test_fastest_lt_and_ratio_per_shape():
    r = router_report.rows(doc())
    assert r[0]["best"]["name"] == "lt heuristic #1" and r[0]["algos"] == 2
    assert r[1]["best"] is None
    md = router_report.markdown(doc())
    assert "| 100:64:8 | 2.00 | 0.4000 (25%) | 0.2000 (50%) | 2.00 | 66, 24, 9, 1, 0 | 2 |" in md, md
    assert "| 50:64:4 | 2.00 | 0.1000 (50%) | n/a | n/a | n/a | 0 |" in md, md
    assert "Geomean layer / fastest cublasLt: 2.000 over 1 shapes" in md


def test_cli_writes_the_table(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(doc()))
    out = tmp_path / "r.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "reports" / "router_report.py"), str(p), "--md", str(out)],
                   check=True)
    assert out.read_text().startswith("router_gemm_bench on GPU at abc")
