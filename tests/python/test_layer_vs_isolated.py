"""bench/reports/layer_vs_isolated.py: the layer's stage against the isolated median of the pick."""
import json
import os
import pathlib
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reports" / "layer_vs_isolated.py"

LOG = """device: NVIDIA H100 80GB HBM3 sm_count=132 hbm_gbps=3352
DeepSeek-V3.2: T=32768 d=7168 n=2048 E=256 K=8
  da_dswiglu N=2048 K=7168 E=256 rows_bucket=10 halves=0 sm_count=132 hbm_gbps=3352
    * da_dswiglu_pp64_c2<256>        20.0000 ms
      da_dswiglu_pp_c2<128>          16.0000 ms  <- winner
    -> da_dswiglu_pp_c2<128> (median of 15, 52 ms)
  up_swiglu N=4096 K=7168 E=256 rows_bucket=10 halves=0 sm_count=132 hbm_gbps=3352
    * up_swiglu_c2<256>              24.0000 ms  <- winner
    -> up_swiglu_c2<256> (median of 15, 52 ms)
"""


def test_pick_time_against_the_layer_stage(tmp_path):
    (tmp_path / "x.tune.log").write_text(LOG)
    # A stub heuristic: pp_c2<128> for dA' (not the log's starred pick), c2<256> for the up-proj.
    stub = tmp_path / "heur"
    stub.write_text("#!/bin/sh\nwhile read k rest; do case $k in da_*) echo 'da_dswiglu_pp_c2<128>';; "
                    "*) echo 'up_swiglu_c2<256>';; esac; done\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    # bench_layer's format (kernel keys end in _ms).
    layer = {"results": [{"config": {"name": "DeepSeek-V3.2"},
                          "kernels": {"bwd.dA_proj_ms": 24.0, "fwd.up_proj_ms": 25.2}}]}
    (tmp_path / "l.json").write_text(json.dumps(layer))
    out = subprocess.run([sys.executable, str(SCRIPT), "--bin", str(stub), "--layer", str(tmp_path / "l.json"),
                          str(tmp_path / "x.tune.log")], capture_output=True, text=True, check=True).stdout
    rows = {l.split("|")[2].strip(): [c.strip() for c in l.split("|")[1:-1]] for l in out.splitlines()
            if l.startswith("| DeepSeek")}
    assert rows["da_dswiglu"][2] == "da_dswiglu_pp_c2<128>" and rows["da_dswiglu"][3] == "16.000"
    assert rows["da_dswiglu"][5] == "**1.50**"  # 24 / 16, flagged
    assert rows["up_swiglu"][5] == "1.05"


def test_layer_ab_reports_are_read_by_name_and_side(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import layer_vs_isolated as m
    rep = {"reports": {"b0_configs": {"rows": [{"config": "X", "stages": {"bwd.dW1": {"a": 2.0, "b0": 3.0}}}]}}}
    (tmp_path / "ab.json").write_text(json.dumps(rep))
    assert m.layer_stages(str(tmp_path / "ab.json"), "b0_configs", "b0") == {"X": {"bwd.dW1": 3.0}}
    assert m.layer_stages(str(tmp_path / "ab.json"), "b0_configs") == {"X": {"bwd.dW1": 2.0}}


def test_logged_picks_from_a_tuner_json(tmp_path):
    # tuner_report.py's JSON: its sets name their configs file (for the rows); the `heuristic`
    # candidate is the logged pick, taken without any binary.
    cfgs = tmp_path / "c.json"
    cfgs.write_text(json.dumps([{"name": "DeepSeek-V3.2", "T": 32768, "d": 7168, "n": 2048, "E": 256, "K": 8}]))
    tj = {"sets": [{"name": "public", "configs": str(cfgs), "keys": [
        {"config": "DeepSeek-V3.2", "kind": "da_dswiglu", "N": 2048, "K": 7168, "E": 256, "halves": False,
         "candidates": [{"config": "da_dswiglu_pp64_c2<256>", "ms": 20.0, "heuristic": True},
                        {"config": "da_dswiglu_pp_c2<128>", "ms": 16.0, "heuristic": False}]}]}]}
    (tmp_path / "t.json").write_text(json.dumps(tj))
    layer = {"results": [{"config": {"name": "DeepSeek-V3.2"}, "kernels": {"bwd.dA_proj_ms": 21.0}}]}
    (tmp_path / "l.json").write_text(json.dumps(layer))
    out = subprocess.run([sys.executable, str(SCRIPT), "--pick", "logged", "--tuner-json", str(tmp_path / "t.json"),
                          "--layer", str(tmp_path / "l.json")], capture_output=True, text=True, check=True).stdout
    row = [c.strip() for c in next(l for l in out.splitlines() if l.startswith("| DeepSeek")).split("|")[1:-1]]
    assert row[2] == "da_dswiglu_pp64_c2<256>" and row[3] == "20.000" and row[5] == "1.05"
    # --pick heuristic without a binary is refused, naming the flag.
    bad = subprocess.run([sys.executable, str(SCRIPT), "--tuner-json", str(tmp_path / "t.json"),
                          "--layer", str(tmp_path / "l.json")], capture_output=True, text=True)
    assert bad.returncode != 0 and "--bin" in bad.stderr
