"""bench/reports/layer_candidates.py (CPU): the near-best candidates of a tune log become one forcing
tune cache per variant (the current pick left out), and the ab step's passes become a per-candidate
table of stage times in the layer."""

import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench/reports"))
spec = importlib.util.spec_from_file_location("layer_candidates", ROOT / "bench/reports/layer_candidates.py")
lc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lc)

# A committed smoe_tune log (H100): DeepSeek-V3.2's up-proj ran up_swiglu<256> 25.711 ms alone against
# the pick (*) up_swiglu_c2<256> 26.782; its down-proj's pick down_store_pp_c2<192> 12.599 against
# down_store_c2<256> 12.618; every other candidate of the two is more than 15% slower.
LOG = ROOT / "bench/results/h100/tune/configs.tune.log"


@pytest.fixture
def out_in_tree():
    """plan's --out-dir must lie inside the tree (its paths go to the device relative to the root)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix=".test_layer_candidates_", dir=ROOT))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_plan_refuses_an_out_dir_outside_the_tree(tmp_path):
    sys.argv = ["layer_candidates.py", "plan", "--log", str(LOG), "--configs", str(ROOT / "bench/configs/configs.json"),
                "--names", "DeepSeek-V3.2", "--out-dir", str(tmp_path / "lc")]
    with pytest.raises(SystemExit, match="must lie inside the tree"):
        lc.main()


def test_plan_forces_each_near_candidate_but_the_pick(tmp_path, out_in_tree):
    out = out_in_tree
    rel = out.relative_to(ROOT)

    def plan(per_key):
        sys.argv = ["layer_candidates.py", "plan", "--log", str(LOG), "--configs", str(ROOT / "bench/configs/configs.json"),
                    "--names", "DeepSeek-V3.2", "--kinds", "up_swiglu,down_store", "--within", "1.15",
                    "--per-key", str(per_key), "--out-dir", str(out)]
        lc.main()
        return json.loads((out / "plan.json").read_text())["variants"]
    # At most --per-key per key, fastest first, then the pick left out: with 1, the down-proj's fastest is
    # its pick (no alternative) and the up-proj's is not.
    v = plan(1)
    assert [(x["variant"], [(e["kind"], e["candidate"]) for e in x["entries"]]) for x in v] == [
        ("v0", [("up_swiglu", "up_swiglu<256>")])]
    # With 3: variant 0 forces the first alternative of both keys (each stage is timed on its own).
    v = plan(3)
    assert len(v) == 1
    assert [(e["kind"], e["candidate"], e["pick"], e["isolated_ms"], e["pick_isolated_ms"], e["uses"])
            for e in v[0]["entries"]] == [
        ("up_swiglu", "up_swiglu<256>", "up_swiglu_c2<256>", 25.7107, 26.7819, [["DeepSeek-V3.2", "fwd.up_proj"]]),
        ("down_store", "down_store_c2<256>", "down_store_pp_c2<192>", 12.6184, 12.599,
         [["DeepSeek-V3.2", "fwd.down_proj"]])]
    cache = json.loads((out / "v0.cache.json").read_text())
    assert cache["version"] == 2
    assert cache["entries"] == [
        {"kind": "up_swiglu", "N": 4096, "K": 7168, "E": 256, "rows_bucket": 10, "halves": False, "sm_count": 132,
         "hbm_gbps": 3352, "config": "up_swiglu<256>"},
        {"kind": "down_store", "N": 7168, "K": 2048, "E": 256, "rows_bucket": 10, "halves": False, "sm_count": 132,
         "hbm_gbps": 3352, "config": "down_store_c2<256>"}]
    assert (out / "variants.txt").read_text() == f"v0:SMOE_ENGINE_TUNE= SMOE_ENGINE_TUNE_CACHE={rel}/v0.cache.json"
    assert [c["name"] for c in json.loads((out / "configs.json").read_text())] == ["DeepSeek-V3.2"]

    # report: device.sh ab's per-pass JSONs of side a and each variant, two rounds.
    ab = tmp_path / "ab"
    ab.mkdir()

    def write(side, rnd, up_ms):
        k = {f"{s}_ms": 1.0 for s in lc.STAGE.values()}
        k["fwd.up_proj_ms"] = up_ms
        (ab / f"{side}_configs_{rnd}.json").write_text(json.dumps(
            {"commit": "abc1234", "gpu": "NVIDIA H100 80GB HBM3",
             "results": [{"config": {"name": "DeepSeek-V3.2"}, "systems": {"ours": {"fwd_ms": 1, "bwd_ms": 2}}, "kernels": k}]}))
    write("a", 1, 27.0), write("a", 2, 26.0)
    write("v0", 1, 28.9), write("v0", 2, 51.4)  # faster alone, slower in the layer
    md = tmp_path / "lc.md"
    sys.argv = ["layer_candidates.py", "report", "--plan", str(out / "plan.json"), "--ab", str(ab), "--md", str(md)]
    lc.main()
    rows = md.read_text().splitlines()[2:]  # after the header line and a blank
    assert md.read_text().startswith("Each GEMM's near-best candidates in the layer (abc1234, NVIDIA H100 80GB HBM3, 2 ")
    # Paired per round (27.0 / 28.9, 26.0 / 51.4): slower in both rounds by more than 3%, the pick's verdict.
    assert rows[2] == ("| DeepSeek-V3.2 | fwd.up_proj | v0 | up_swiglu<256> | 25.711 | 28.900 | 28.90 / 51.40 | "
                       "up_swiglu_c2<256> | 26.782 | 26.000 | 0.900 | 0.93 / 0.51 | pick |")
    # The down-proj's stage is 1.0 ms on both sides here: ratio 1, no verdict.
    assert rows[3].startswith("| DeepSeek-V3.2 | fwd.down_proj | v0 | down_store_c2<256> | 12.618 | 1.000 |")
    assert rows[3].endswith("| 1.000 | 1.000 | 1.00 / 1.00 | - |")
    assert "the candidate faster on 0 of 2 forced stages, the pick faster on 1." in md.read_text()
    assert "picks to re-read" not in md.read_text()

    # A candidate faster in one round only gets no verdict; faster in every round by more than the margin,
    # the candidate's, and it is listed with the time it saved; --json keeps both sides' rounds.
    write("v0", 1, 25.0), write("v0", 2, 26.5)  # 27.0 / 25.0 = 1.08, 26.0 / 26.5 = 0.98
    jsn = tmp_path / "lc.json"
    sys.argv = ["layer_candidates.py", "report", "--plan", str(out / "plan.json"), "--ab", str(ab), "--md", str(md),
                "--json", str(jsn)]
    lc.main()
    assert md.read_text().splitlines()[4].endswith("| 1.08 / 0.98 | - |")
    write("v0", 1, 25.0), write("v0", 2, 25.0)  # 1.08, 1.04
    lc.main()
    text = md.read_text()
    assert text.splitlines()[4].endswith("| 1.08 / 1.04 | candidate |")
    assert "the candidate faster on 1 of 2 forced stages, the pick faster on 0." in text
    assert ("| up_swiglu | 4096 | 7168 | 256 | 10 | DeepSeek-V3.2 | up_swiglu_c2<256> -> up_swiglu<256> | "
            "1.040-1.080 | 1.000 |") in text
    doc = json.loads(jsn.read_text())
    assert (doc["commit"], doc["rounds"], doc["margin"]) == ("abc1234", 2, 0.03)
    assert [p["results"][0]["kernels"]["fwd.up_proj_ms"] for p in doc["a_passes"]] == [27.0, 26.0]
    up = doc["rows"][0]
    assert (up["verdict"], up["pick_ms"], up["candidate_ms"]) == ("candidate", [27.0, 26.0], [25.0, 25.0])
    # --margin 0.05: 1.04 is inside it.
    sys.argv += ["--margin", "0.05"]
    lc.main()
    assert md.read_text().splitlines()[4].endswith("| 1.08 / 1.04 | - |")
    # A variant without passes is listed as not run.
    plan_doc = json.loads((out / "plan.json").read_text())
    plan_doc["variants"][0]["variant"] = "v9"
    (out / "plan9.json").write_text(json.dumps(plan_doc))
    sys.argv = ["layer_candidates.py", "report", "--plan", str(out / "plan9.json"), "--ab", str(ab), "--md", str(md)]
    lc.main()
    assert "| v9 | up_swiglu<256> | 25.711 | not run |" in md.read_text()
