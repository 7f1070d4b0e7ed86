"""bench/reports/candidate_group.py: per key, the group's fastest against the rest's fastest."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reports" / "candidate_group.py"

LOG = """tune cache: /tmp/x.json
device: NVIDIA H100 80GB HBM3 sm_count=132 hbm_gbps=3352
120B n1024 E128 K8: T=32768 d=4096 n=1024 E=128 K=8
  da_dswiglu N=1024 K=4096 E=128 rows_bucket=18 halves=0 sm_count=132 hbm_gbps=3352
    * da_dswiglu_pp<128>              4.0000 ms  <- winner
      da_dswiglu<256>                 3.5000 ms
      da_dswiglu_c2<256>              3.6000 ms
      da_dswiglu_pp64_c2<256>         4.4000 ms
    -> da_dswiglu_pp<128> (median of 15, 52 ms)
  up_swiglu N=2048 K=4096 E=128 rows_bucket=18 halves=0 sm_count=132 hbm_gbps=3352
    * up_swiglu_c2<256>               6.0000 ms  <- winner
      up_swiglu<256>                  6.1000 ms
    -> up_swiglu_c2<256> (median of 15, 52 ms)
7B n256 E128 K8: T=24576 d=1536 n=256 E=128 K=8
  da_dswiglu N=256 K=1536 E=128 rows_bucket=17 halves=0 sm_count=132 hbm_gbps=3352
    * da_dswiglu_pp<128>              0.4000 ms  <- winner
      da_dswiglu<128>                 0.4400 ms
    -> da_dswiglu_pp<128> (median of 15, 52 ms)
"""


def test_group_against_rest(tmp_path):
    log = tmp_path / "x.tune.log"
    log.write_text(LOG)
    out = subprocess.run([sys.executable, str(SCRIPT), "--kind", "da_dswiglu", "--group",
                          "da_dswiglu<256>,da_dswiglu_c2<256>", str(log)], capture_output=True, text=True, check=True).stdout
    lines = [l for l in out.splitlines() if l.startswith("| 120B")]
    assert len(lines) == 1  # 7B's key timed no group member; the up-proj key is another kind
    cells = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert cells[3] == "da_dswiglu_pp<128>" and cells[5] == "da_dswiglu_pp<128>" and cells[7] == "da_dswiglu<256>"
    assert cells[9] == f"{4.0 / 3.5:.3f}"
    assert "1 keys" in out and "wins by >= 5% on 1" in out
