"""CPU test of bench/drivers/side_by_side.py --merge (no torch, no GPU): results of config subsets in
one document, in the order of the configs files given (several, comma-separated), each config once.
    python3 -m pytest -q tests/python/test_side_by_side_merge.py
"""
import json
import os
import subprocess
import sys

SYSTEMS = ("ours", "torch_grouped_mm", "sonicmoe")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "drivers", "side_by_side.py")


def cfg(name, K=8):
    return {"name": name, "T": 1024, "d": 512, "n": 256, "E": 16, "K": K}


def doc(names):
    return {"commit": "c", "gpu": "g", "driver": "1", "cuda": "13", "torch": "2", "date": "2026-12-06",
            "results": [{"config": cfg(n), "systems": {k: {"error": "not run"} for k in SYSTEMS}} for n in names]}


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def merge(tmp_path, files, configs_file):
    out = str(tmp_path / "merged.json")
    r = subprocess.run([sys.executable, SCRIPT, "--merge", *files, "--configs-file", configs_file, "--out", out],
                       capture_output=True, text=True)
    return r, (json.load(open(out)) if r.returncode == 0 else None)


def test_merge_orders_by_several_configs_files(tmp_path):
    a = write(tmp_path, "a.json", [cfg("pub1"), cfg("pub2")])
    b = write(tmp_path, "b.json", [cfg("wide1", K=1), cfg("wide2")])
    r1 = write(tmp_path, "r1.json", doc(["wide2", "pub2"]))
    r2 = write(tmp_path, "r2.json", doc(["wide1", "pub1"]))
    r, out = merge(tmp_path, [r1, r2], f"{a},{b}")
    assert r.returncode == 0, r.stderr
    assert [x["config"]["name"] for x in out["results"]] == ["pub1", "pub2", "wide1", "wide2"]


def test_a_name_in_two_configs_files_is_refused(tmp_path):
    a = write(tmp_path, "a.json", [cfg("same")])
    b = write(tmp_path, "b.json", [cfg("same")])
    r1 = write(tmp_path, "r1.json", doc(["same"]))
    r, _ = merge(tmp_path, [r1], f"{a},{b}")
    assert r.returncode != 0 and "more than one" in (r.stderr + r.stdout)


def test_a_config_in_two_results_is_refused(tmp_path):
    a = write(tmp_path, "a.json", [cfg("x"), cfg("y")])
    r1 = write(tmp_path, "r1.json", doc(["x"]))
    r2 = write(tmp_path, "r2.json", doc(["x", "y"]))
    r, _ = merge(tmp_path, [r1, r2], a)
    assert r.returncode != 0 and "more than one file" in (r.stderr + r.stdout)
