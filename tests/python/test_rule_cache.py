"""bench/reports/rule_cache.py (CPU): the layer's GEMM keys are the ones smoe_tune logs, and a rule
change's old picks become a tune cache for exactly the keys whose pick changed, with the changed
shapes (and controls) as a configs file."""

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench/reports"))
spec = importlib.util.spec_from_file_location("rule_cache", ROOT / "bench/reports/rule_cache.py")
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)


def test_key_map_matches_committed_tune_logs():
    # Real smoe_tune output (H100): every key of every config is the map's.
    for name in ("configs", "wide_configs", "sweep_configs", "tune_extra_configs"):
        assert rc.check_log(str(ROOT / f"bench/results/h100/tune/{name}.tune.log"))


def test_key_map_check_fails_on_a_key_it_does_not_make(tmp_path):
    log = tmp_path / "bad.tune.log"
    log.write_text("x: T=1024 d=768 n=256 E=8 K=2\n"
                   "  da_dswiglu N=768 K=256 E=8 rows_bucket=8 halves=0 sm_count=132\n")  # N and K swapped
    assert not rc.check_log(str(log))


def test_rows_bucket_is_the_tune_caches():
    assert rc.rows_bucket(40960 * 8, 128) == 11  # 2560 rows per expert
    assert rc.rows_bucket(2043 * 8, 64) == 7  # 255: floor of log2
    assert rc.rows_bucket(1, 8) == 0


def fake_heuristic(tmp_path, name, da_pick):
    """A stand-in smoe_heuristic: 'base' for every key, da_pick for dA' keys with K >= 4096."""
    p = tmp_path / name
    p.write_text(f"#!{sys.executable}\n"
                 "import sys\n"
                 "for line in sys.stdin:\n"
                 "    f = line.split(); k = int(f[2].split('=')[1])\n"
                 f"    print('{da_pick}' if f[0] == 'da_dswiglu' and k >= 4096 else 'base')\n")
    p.chmod(0o755)
    return str(p)


def test_old_picks_of_changed_keys_only(tmp_path):
    cfgs = [dict(name="small", T=4096, d=2048, n=512, E=64, K=4),
            dict(name="big", T=4096, d=4096, n=1024, E=64, K=8),
            dict(name="big2", T=8192, d=6144, n=1024, E=32, K=2),
            dict(name="small2", T=512, d=1024, n=256, E=16, K=2)]
    cf = tmp_path / "c.json"
    cf.write_text(json.dumps(cfgs))
    old, new = fake_heuristic(tmp_path, "old", "da_old"), fake_heuristic(tmp_path, "new", "da_new")
    out_c, out_k = tmp_path / "changed.json", tmp_path / "old.cache.json"
    sys.argv = ["rule_cache.py", "--old", old, "--new", new, "--configs", str(cf), "--hbm-gbps", "3352",
                "--controls", "1", "--out-configs", str(out_c), "--out-cache", str(out_k)]
    rc.main()
    assert [c["name"] for c in json.loads(out_c.read_text())] == ["big", "big2", "small"]
    cache = json.loads(out_k.read_text())
    assert cache["version"] == 2
    assert [(e["kind"], e["N"], e["K"], e["E"], e["rows_bucket"], e["config"], e["hbm_gbps"]) for e in cache["entries"]] == [
        ("da_dswiglu", 1024, 4096, 64, 9, "da_old", 3352), ("da_dswiglu", 1024, 6144, 32, 9, "da_old", 3352)]


def layer_json(path, stages_by_config):
    """A bench_layer results file: {config name: {stage: ms}}; the other GEMM stages at 1 ms."""
    res = []
    for name, st in stages_by_config.items():
        k = {f"{s}_ms": 1.0 for s in rc.STAGE.values()}
        k.update({f"{s}_ms": v for s, v in st.items()})
        k["fwd.routing_ms"] = 0.1  # not a GEMM stage: never scored
        res.append({"config": {"name": name}, "systems": {"ours": {"fwd_ms": 1.0, "bwd_ms": 2.0}}, "kernels": k})
    path.write_text(json.dumps({"results": res}))
    return str(path)


def test_score_takes_the_changed_stages_lowest_pass_and_rounds(tmp_path):
    # Two configs files, two rounds each; "big" changed its dA' pick, "x" nothing.
    a = [layer_json(tmp_path / "a1.json", {"big": {"bwd.dA_proj": 3.0}}),
         layer_json(tmp_path / "a2.json", {"big": {"bwd.dA_proj": 2.0}}),
         layer_json(tmp_path / "ax1.json", {"x": {"fwd.up_proj": 1.1}}),
         layer_json(tmp_path / "ax2.json", {"x": {}})]
    b = [layer_json(tmp_path / "b1.json", {"big": {"bwd.dA_proj": 1.5}}),
         layer_json(tmp_path / "b2.json", {"big": {"bwd.dA_proj": 4.0}}),
         layer_json(tmp_path / "bx1.json", {"x": {}}),
         layer_json(tmp_path / "bx2.json", {"x": {"fwd.up_proj": 0.5}})]
    changes = {"big": {"bwd.dA_proj": ("da_old", "da_new")}}
    rows, noise = rc.score(changes, a, b, ["big", "x"])
    assert len(rows) == 1
    r = rows[0]
    assert (r["config"], r["stage"], r["old"], r["new"]) == ("big", "bwd.dA_proj", "da_old", "da_new")
    assert r["ratio"] == 2.0 / 1.5  # lowest pass per side
    assert r["rounds"] == [3.0 / 1.5, 2.0 / 4.0]  # each round's own ratio, in order
    # big's five other GEMM stages and x's six are the noise: x's up-proj is min(1.1, 1.0) / min(1.0, 0.5).
    assert len(noise) == 11 and sorted(noise)[-1] == 2.0 and noise.count(1.0) == 10
    # The other order of the same passes (all of one file's rounds first) is the same two rounds.
    rows2, _ = rc.score(changes, [a[0], a[2], a[1], a[3]], [b[0], b[2], b[1], b[3]], ["big", "x"])
    assert rows2 == rows
    # device.sh ab's names (<side>_<set>_<round>.json) group by set even where a pass lost a config
    # (bench_layer records an error for a config it could not run: its names then differ).
    a_ab = [layer_json(tmp_path / "a_s_1.json", {"big": {"bwd.dA_proj": 3.0}, "y": {}}),
            layer_json(tmp_path / "a_t_1.json", {"x": {}}),
            layer_json(tmp_path / "a_s_2.json", {"big": {"bwd.dA_proj": 2.0}}),
            layer_json(tmp_path / "a_t_2.json", {"x": {}})]
    b_ab = [layer_json(tmp_path / "b_s_1.json", {"big": {"bwd.dA_proj": 1.5}, "y": {}}),
            layer_json(tmp_path / "b_t_1.json", {"x": {}}),
            layer_json(tmp_path / "b_s_2.json", {"big": {"bwd.dA_proj": 4.0}, "y": {}}),
            layer_json(tmp_path / "b_t_2.json", {"x": {}})]
    rows3, noise3 = rc.score(changes, a_ab, b_ab, ["big", "x", "y"])
    assert rows3 == rows and len(noise3) == 11  # y, missing from one pass of side a, is left out
    # Configs the picks were not asked for (not in --configs) are left out, not read as noise.
    rows4, noise4 = rc.score(changes, a_ab, b_ab, ["big"])
    assert rows4 == rows and len(noise4) == 5
    md = rc.score_md(rows, noise)
    assert "| big | bwd.dA_proj | da_old -> da_new | 2.000 | 1.500 | 1.333 | 2.00 / 0.50 |" in md
    assert "Changed stages: 1" in md and "Unchanged GEMM stages" in md
    assert "Per round, the changed stages' geomean a / b: 2.000 / 0.500." in md
    two = rc.score_md(rows + [dict(rows[0], stage="fwd.up_proj", rounds=[0.5, 2.0])], noise)
    assert "Per round, the changed stages' geomean a / b: 1.000 / 1.000." in two
