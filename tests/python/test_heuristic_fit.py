"""bench/reports/heuristic_fit.py and build/smoe_heuristic (CPU): tune logs parse into keys with the
exact rows, the binary answers every key with this build's heuristic, and the regrets are the
pick's time over the fastest. SMOE_HEURISTIC_BIN names the binary (CTest sets it); without it the
tests that need it skip."""

import importlib.util
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("heuristic_fit", ROOT / "bench/reports/heuristic_fit.py")
fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit)

BIN = os.environ.get("SMOE_HEURISTIC_BIN", "")
need_bin = pytest.mark.skipif(not (BIN and os.access(BIN, os.X_OK)), reason="SMOE_HEURISTIC_BIN not set")

# The layout smoe_tune prints (apps/smoe_tune.cu): a config line, then per key its candidates, `*` the
# heuristic's pick, `<- winner` the stored one. Times are made up.
LOG = """\
1.4B n256 E128 K8: T=40960 d=768 n=256 E=128 K=8
  up_swiglu N=512 K=768 E=128 rows_bucket=11 halves=0 sm_count=132
    * up_swiglu_pp64_c2<256>  0.4841 ms
      up_swiglu<128>  0.5252 ms
      up_swiglu<256>  0.4665 ms  <- winner
  down_store N=768 K=256 E=128 rows_bucket=11 halves=0 sm_count=132
    * down_store_pps2<192>  0.3000 ms  <- winner
      down_store_pp<128>  inf ms
wide E8 K1 n16384 d2048: T=16384 d=2048 n=16384 E=8 K=1
  dw_gather_p_t N=2048 K=32768 E=8 rows_bucket=11 halves=0 sm_count=132
    * dw_gather_p_t<256>  2.0000 ms  <- winner
"""


def write_log(tmp_path):
    p = tmp_path / "t.tune.log"
    p.write_text(LOG)
    return str(p)


def test_device_bandwidth_from_the_device_line_or_the_key(tmp_path):
    p = tmp_path / "d.tune.log"
    p.write_text("device: NVIDIA H100 80GB HBM3 sm_count=132 hbm_gbps=3352\n" + LOG.replace(
        "rows_bucket=11 halves=0 sm_count=132\n    * dw_gather_p_t", "rows_bucket=11 halves=0 sm_count=132 hbm_gbps=4917\n"
        "    * dw_gather_p_t"))
    keys = fit.parse_log(str(p))
    assert [k["hbm_gbps"] for k in keys] == [3352, 3352, 4917]
    assert [k["hbm_gbps"] for k in fit.parse_log(write_log(tmp_path))] == [0, 0, 0]


def test_parse_log_rows_candidates_and_logged_pick(tmp_path):
    keys = fit.parse_log(write_log(tmp_path))
    assert [k["kind"] for k in keys] == ["up_swiglu", "down_store", "dw_gather_p_t"]
    assert keys[0]["rows"] == 40960 * 8 and keys[2]["rows"] == 16384
    assert keys[0]["logged"] == "up_swiglu_pp64_c2<256>"
    assert keys[0]["cands"]["up_swiglu<256>"] == pytest.approx(0.4665)
    assert keys[1]["cands"]["down_store_pp<128>"] == float("inf")


def test_score_regrets_and_sums(tmp_path):
    keys = fit.parse_log(write_log(tmp_path))
    for k, p in zip(keys, ["up_swiglu<128>", "down_store_pp<128>", "dw_gather_p_t<256>"]):
        k["pick"] = p
    sums = fit.score(keys)
    assert keys[0]["best"] == "up_swiglu<256>"
    assert keys[0]["pick_regret"] == pytest.approx(0.5252 / 0.4665)
    assert keys[0]["logged_regret"] == pytest.approx(0.4841 / 0.4665)
    assert keys[1]["pick_regret"] is None  # a failed (inf) candidate never counts as a pick's time
    assert sums["kind"]["up_swiglu"]["misses"] == 1
    assert "down_store" not in sums["kind"]  # no finite pick: left out of the sums, listed as unmeasured
    md = fit.markdown(keys, sums, ["t.tune.log"])
    assert "unmeasured" in md and "| up_swiglu | 1 | 1.038 | 1.126 | 1 |" in md


@need_bin
def test_binary_answers_every_key_with_a_label_of_its_kind(tmp_path):
    keys = fit.parse_log(write_log(tmp_path))
    picks = fit.heuristic_picks(BIN, keys)
    assert len(picks) == 3
    for k, p in zip(keys, picks):  # exactly the key's kind (dw_gather_p_t stays the transposed kind)
        assert re.fullmatch(re.escape(k["kind"]) + r"(_pp|_pps|_pps2|_pp64)?(_c2)?<\d+>", p), (k["kind"], p)


@need_bin
def test_binary_takes_the_lean_rules_below_4_tbs():
    line = "dx_store N=4096 K=2048 E=128 rows=262144 halves=0 sm_count=132"  # 120B's dX~
    out = subprocess.run([BIN], input=f"{line}\n{line} hbm_gbps=3352\n{line} hbm_gbps=4917\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["dx_store_pp<192>", "dx_store_pp_c2<192>", "dx_store_pp<192>"]


@need_bin
def test_binary_rejects_bad_lines_by_name():
    out = subprocess.run([BIN], input="nope N=1\nup_swiglu N=512 K=768\nup_swiglu N=0 K=1 E=1 rows=1 halves=0 sm_count=1\n"
                         "up_swiglu N=512 K=768 E=8 rows=64 halves=0 sm_count=132 extra=1\n",
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "error: unknown kind nope"
    assert out[1].startswith("error: expected")
    assert out[2].startswith("error: N, K, E")
    assert out[3].startswith("error: after sm_count")
