"""scripts/device.sh ab on the CPU with stand-in binaries: side A is the build's bench_layer, each
variant of AB_VARIANTS runs side B with its environment, the digests are compared, and layer_ab.py
reports every variant per configs file."""
import json
import os
import pathlib
import stat
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

FAKE_BENCH = r'''#!/usr/bin/env python3
import json, os, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
cfgs = json.load(open(a["--configs"]))
speed = float(os.environ.get("FAKE_SPEED", "1"))  # side B's variants set it through AB_VARIANTS
res = [{"config": c, "systems": {"ours": {"fwd_ms": 1.0 / speed, "bwd_ms": 2.0 / speed}},
        "kernels": {"bwd.dW1_ms": 0.5, "bwd.dW2_ms": 0.25}} for c in cfgs]
json.dump({"commit": a.get("--commit", "?"), "results": res}, open(a["--out"], "w"))
'''


def write_exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_ab(tmp_path, digest_b_text, **env):
    build = tmp_path / "build"
    build.mkdir(exist_ok=True)
    write_exe(build / "bench_layer", FAKE_BENCH)
    # layer_digest: prints what the test says (`$0`: its own path, which differs between side A's copy
    # and the build's).
    write_exe(build / "layer_digest", f'#!/usr/bin/env bash\necho "{digest_b_text}"\n')
    out = tmp_path / "out"
    e = dict(os.environ, BUILD=str(build), OUT=str(out), AB_CONFIGS="smoke_configs", AB_ROUNDS="2",
             SMOE_COMMIT="test")
    e.update(env)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "ab"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=120)
    return r, out / "ab"


def test_variants_reach_side_b_and_are_reported(tmp_path):
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="same:;fast:FAKE_SPEED=1.25")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "digest: same == a (bitwise)" in r.stdout
    same = json.loads((d / "ab_same_smoke_configs.json").read_text())
    fast = json.loads((d / "ab_fast_smoke_configs.json").read_text())
    assert abs(same["summary"]["geomean"] - 1.0) < 1e-9
    assert abs(fast["summary"]["geomean"] - 1.25) < 1e-9
    assert len(list(d.glob("a_smoke_configs_*.json"))) == 2
    assert "Geomean speedup 1.250" in (d / "ab_fast_smoke_configs.md").read_text()


def test_differing_digest_fails_the_step(tmp_path):
    # Side A's digest binary is the build's copy taken first: make the build's differ afterwards by
    # having the stand-in print its own path (side A runs from the copy, B from the build).
    r, _ = run_ab(tmp_path, "x $0")
    assert r.returncode == 1
    assert "digest: b DIFFERS from a" in r.stdout


def test_digest_variants_check_each_named_switch(tmp_path):
    # A stack of switched patches: every variant's digest is compared with A's, each in its own file;
    # one that differs is named and fails the step, the others still pass.
    r, d = run_ab(tmp_path, "x ${FAKE_DIGEST:-1}", AB_VARIANTS="off:;rule:FAKE_SPEED=1.1;odd:FAKE_DIGEST=2",
                  AB_DIGEST_VARIANTS="all")
    assert r.returncode == 1
    assert "digest: off == a (bitwise)" in r.stdout and "digest: rule == a (bitwise)" in r.stdout
    assert "digest: odd DIFFERS from a" in r.stdout
    assert (d / "digest_off.txt").exists() and (d / "digest_rule.txt").exists()
    assert (d / "digest_odd.txt").read_text().strip() == "x 2"
    # A later variant named b keeps its own file, not the first variant's digest_b.txt.
    r, d = run_ab(tmp_path, "x ${FAKE_DIGEST:-1}", AB_VARIANTS="x:FAKE_DIGEST=2;b:", AB_DIGEST_VARIANTS="all")
    assert "digest: x DIFFERS from a" in r.stdout and "digest: b == a (bitwise)" in r.stdout
    assert (d / "digest_x.txt").read_text().strip() == "x 2" and (d / "digest_b.txt").read_text().strip() == "x 1"
    assert (d / "ab_rule_smoke_configs.md").exists()  # the rounds still ran
    r, d = run_ab(tmp_path, "x ${FAKE_DIGEST:-1}", AB_VARIANTS="off:;odd:FAKE_DIGEST=2", AB_DIGEST_VARIANTS="off")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "odd" not in "".join(l for l in r.stdout.splitlines() if l.startswith("digest"))


def test_a_digest_variant_not_in_the_variants_is_refused_before_anything_runs(tmp_path):
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="off:;rule:", AB_DIGEST_VARIANTS="off,typo")
    assert r.returncode == 1
    assert "AB_DIGEST_VARIANTS: 'typo' is not in AB_VARIANTS" in r.stdout
    assert not d.exists() or not list(d.glob("*"))


def test_a_variant_without_environment(tmp_path):
    # 'plain' (no colon) runs side B with no variables; 'x:' the same.
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="plain;x:")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("plain", "x"):
        doc = json.loads((d / f"ab_{name}_smoke_configs.json").read_text())
        assert abs(doc["summary"]["geomean"] - 1.0) < 1e-9


def test_bad_variant_name_is_refused(tmp_path):
    r, _ = run_ab(tmp_path, "x 1", AB_VARIANTS="a:FOO=1")
    assert r.returncode == 1
    assert "bad name 'a'" in r.stdout


def test_unseen_stem_runs_the_seeded_draw(tmp_path):
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="b:", AB_CONFIGS="unseen", AB_UNSEEN_SEED="11")
    assert r.returncode == 0, r.stdout + r.stderr
    drawn = json.loads((d / "unseen.json").read_text())
    assert drawn and all("unseen.py --seed 11" in c["source"] for c in drawn)
    side_a = json.loads((d / "a_unseen_1.json").read_text())
    assert [x["config"]["name"] for x in side_a["results"]] == [c["name"] for c in drawn]
    assert (d / "ab_b_unseen.md").exists()


def test_scoped_entries_run_only_their_variants(tmp_path):
    # 'fast=smoke_configs': A and fast only; the plain entry runs every variant. Each report exists only
    # where its variant ran, and no run of 'same' touches the scoped file.
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="same:;fast:FAKE_SPEED=1.25",
                  AB_CONFIGS="fast=smoke_configs same=unseen", AB_UNSEEN_SEED="11")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(list(d.glob("a_smoke_configs_*.json"))) == 2
    assert len(list(d.glob("fast_smoke_configs_*.json"))) == 2
    assert not list(d.glob("same_smoke_configs_*")) and not list(d.glob("fast_unseen_*"))
    assert len(list(d.glob("same_unseen_*.json"))) == 2 and (d / "unseen.json").exists()
    fast = json.loads((d / "ab_fast_smoke_configs.json").read_text())
    assert abs(fast["summary"]["geomean"] - 1.25) < 1e-9
    assert (d / "ab_same_unseen.md").exists() and not (d / "ab_same_smoke_configs.md").exists()


def test_scoped_entry_naming_an_unknown_variant_is_refused_before_anything_runs(tmp_path):
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="same:", AB_CONFIGS="same,typo=smoke_configs")
    assert r.returncode == 1
    assert "variant 'typo' of 'same,typo=smoke_configs' is not in AB_VARIANTS" in r.stdout
    assert not d.exists() or not list(d.glob("*.json"))


def dry_run(tmp_path, step, **env):
    """scripts/device.sh STEP with DEVICE_DRY_RUN=1: it prints every command ('+ ...'), runs none."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("AB_") and k != "BUILD_TARGETS"}
    e.update(DEVICE_DRY_RUN="1", BUILD=str(tmp_path / "build"), OUT=str(tmp_path / "out"), SMOE_COMMIT="test")
    e.update(env)
    return subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), step], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=60)


def test_several_patches_apply_in_order_and_revert_in_reverse(tmp_path):
    # Both patches applied in the given order (cumulative, as docs/wip's check applies them), side B
    # built once, tested, and the tree restored last-first.
    r = dry_run(tmp_path, "ab", AB_PATCH="docs/wip/one.patch docs/wip/two.patch", AB_TEST_FILTER="GpuEngine.*",
                AB_CONFIGS="smoke_configs", AB_ROUNDS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    want = ["git apply docs/wip/one.patch", "git apply docs/wip/two.patch", "cmake --build",
            "test_gpu", "git apply -R docs/wip/two.patch", "git apply -R docs/wip/one.patch"]
    at = [next(i for i, ln in enumerate(lines) if w in ln) for w in want]
    assert at == sorted(at), lines
    assert sum("git apply" in ln for ln in lines) == 4, lines


def dry_ab_sides(tmp_path, **env):
    """The sides' output files in the order a dry run would run them."""
    r = dry_run(tmp_path, "ab", **{"AB_CONFIGS": "smoke_configs", "AB_ROUNDS": "3", "AB_VARIANTS": "b:;c:X=1", **env})
    runs = [ln.split("--out ")[1].split()[0].rsplit("/", 1)[1] for ln in r.stdout.splitlines()
            if ln.startswith("+ ") and "--configs " in ln and "--out " in ln]
    return r, runs


def test_rounds_alternate_their_order_by_default(tmp_path):
    # Even rounds run the sides in reverse, so no side always runs first or after the same one.
    r, runs = dry_ab_sides(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert runs == ["a_smoke_configs_1.json", "b_smoke_configs_1.json", "c_smoke_configs_1.json",
                    "c_smoke_configs_2.json", "b_smoke_configs_2.json", "a_smoke_configs_2.json",
                    "a_smoke_configs_3.json", "b_smoke_configs_3.json", "c_smoke_configs_3.json"], runs


def test_fixed_order_keeps_a_first(tmp_path):
    r, runs = dry_ab_sides(tmp_path, AB_ORDER="fixed", AB_ROUNDS="2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert runs == ["a_smoke_configs_1.json", "b_smoke_configs_1.json", "c_smoke_configs_1.json",
                    "a_smoke_configs_2.json", "b_smoke_configs_2.json", "c_smoke_configs_2.json"], runs


def test_unknown_order_is_refused(tmp_path):
    r, runs = dry_ab_sides(tmp_path, AB_ORDER="random")
    assert r.returncode == 1
    assert "AB_ORDER=random: alternate or fixed" in r.stdout
    assert runs == []


def test_build_targets_limit_the_build(tmp_path):
    r = dry_run(tmp_path, "build", BUILD_TARGETS="gather_sum_bench test_gpu")
    builds = [ln for ln in r.stdout.splitlines() if ln.startswith("+ cmake --build")]
    assert len(builds) == 1 and builds[0].endswith("--target gather_sum_bench test_gpu"), r.stdout
    r = dry_run(tmp_path, "build")
    builds = [ln for ln in r.stdout.splitlines() if ln.startswith("+ cmake --build")]
    assert len(builds) == 1 and "--target" not in builds[0], r.stdout


def test_build_patch_is_applied_in_order_before_the_build(tmp_path):
    r = dry_run(tmp_path, "build", BUILD_PATCH="docs/wip/b.patch docs/wip/a.patch")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    applies = [i for i, ln in enumerate(lines) if ln.startswith("+ git apply")]
    assert [lines[i] for i in applies] == ["+ git apply docs/wip/b.patch", "+ git apply docs/wip/a.patch"], r.stdout
    assert applies[-1] < next(i for i, ln in enumerate(lines) if ln.startswith("+ cmake -S"))
    r = dry_run(tmp_path, "build")
    assert "git apply" not in r.stdout


def test_sanitize_filter_replaces_every_tools_filter(tmp_path):
    r = dry_run(tmp_path, "sanitize", SANITIZE_TOOLS="racecheck synccheck", SANITIZE_FILTER="GpuLayer.SmallShapes*")
    runs = [ln for ln in r.stdout.splitlines() if "compute-sanitizer" in ln]
    assert len(runs) == 2 and all(ln.endswith("--gtest_filter=GpuLayer.SmallShapes\\*") for ln in runs), runs
    r = dry_run(tmp_path, "sanitize", SANITIZE_TOOLS="racecheck")
    assert "GpuEngine.DSwiGLUGathered" in next(ln for ln in r.stdout.splitlines() if "compute-sanitizer" in ln)


def test_side_b_builds_the_targets_side_a_built(tmp_path):
    # A patch's side B rebuilds BUILD_TARGETS (and test_gpu when AB_TEST_FILTER runs it), not the tree.
    def side_b_build(**env):
        r = dry_run(tmp_path, "ab", AB_PATCH="docs/wip/one.patch", AB_CONFIGS="smoke_configs", AB_ROUNDS="1", **env)
        assert r.returncode == 0, r.stdout + r.stderr
        return [ln for ln in r.stdout.splitlines() if ln.startswith("+ cmake --build")]
    b = side_b_build(BUILD_TARGETS="bench_layer layer_digest")
    assert len(b) == 1 and b[0].endswith("--target bench_layer layer_digest"), b
    b = side_b_build(BUILD_TARGETS="bench_layer layer_digest", AB_TEST_FILTER="GpuEngine.*")
    assert len(b) == 1 and b[0].endswith("--target bench_layer layer_digest test_gpu"), b
    # What the A/B runs of side B is built even where BUILD_TARGETS leaves it out (never a stale side B).
    b = side_b_build(BUILD_TARGETS="smoe_tune")
    assert len(b) == 1 and b[0].endswith("--target smoe_tune bench_layer layer_digest"), b
    b = side_b_build(BUILD_TARGETS="smoe_tune", AB_DIGEST="0")
    assert len(b) == 1 and b[0].endswith("--target smoe_tune bench_layer"), b
    b = side_b_build()
    assert len(b) == 1 and "--target" not in b[0], b


def test_a_configs_path_runs_that_file_named_by_its_stem(tmp_path):
    # An AB_CONFIGS entry with a '/' is a configs file anywhere (e.g. docs/wip/<name>.heldout.json),
    # its reports named by the file name; stems keep meaning bench/configs/<stem>.json.
    held = tmp_path / "rule.heldout.json"
    held.write_text(json.dumps([{"name": "h1", "T": 64, "d": 128, "n": 128, "E": 4, "K": 2},
                                {"name": "h2", "T": 64, "d": 128, "n": 128, "E": 4, "K": 1}]))
    r, d = run_ab(tmp_path, "x 1", AB_VARIANTS="fast:FAKE_SPEED=2", AB_CONFIGS=f"smoke_configs {held}")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((d / "ab_fast_rule.heldout.json").read_text())
    assert abs(rep["summary"]["geomean"] - 2.0) < 1e-9
    assert [row["config"] for row in rep["rows"]] == ["h1", "h2"]
    assert (d / "ab_fast_smoke_configs.json").exists()


def test_build_unpacks_googletest_from_whl(tmp_path):
    # A call carrying .whl (SonicMoE's wheels, the CUTLASS headers, GoogleTest's sources) and no .deps:
    # the build step unpacks GoogleTest and hands it to CMake (stand-in cmake / nvcc record their args).
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("device.sh", "versions.env"):
        (repo / "scripts" / f).write_text((ROOT / "scripts" / f).read_text())
    src = tmp_path / "src"
    (src / ".deps/googletest/googletest").mkdir(parents=True)
    (src / ".deps/googletest/CMakeLists.txt").write_text("# stand-in\n")
    (repo / ".whl").mkdir()
    subprocess.run(["tar", "cJf", str(repo / ".whl/googletest.tar.xz"), ".deps/googletest"], cwd=src, check=True)
    ver = next(ln.split("=", 1)[1].strip().strip('"') for ln in (ROOT / "scripts/versions.env").read_text().splitlines()
               if ln.startswith("CUTLASS_PIP_VERSION="))
    inc = repo / f".deps/cutlass-{ver}/cutlass_library/source/include/cutlass"
    inc.mkdir(parents=True)
    (inc / "cutlass.h").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "cmake.log"
    write_exe(bin_dir / "cmake", f'#!/usr/bin/env bash\necho "$@" >> "{log}"\n')
    write_exe(bin_dir / "nvcc", "#!/usr/bin/env bash\n")
    e = {k: v for k, v in os.environ.items() if k != "BUILD_TARGETS"}
    e.update(PATH=f"{bin_dir}:{e['PATH']}", OUT=str(tmp_path / "out"), BUILD=str(tmp_path / "build"), SMOE_COMMIT="t")
    r = subprocess.run(["bash", str(repo / "scripts/device.sh"), "build"], cwd=repo, env=e, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (repo / ".deps/googletest/CMakeLists.txt").exists()
    configure = log.read_text().splitlines()[0]
    assert f"-DSMOE_GTEST_SOURCE_DIR={repo}/.deps/googletest" in configure, configure


def test_router_step_runs_the_bench_with_its_shapes(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    out = tmp_path / "out"
    e = dict(os.environ, BUILD=str(build), OUT=str(out), SMOE_COMMIT="test")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "router"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no " + str(build / "router_gemm_bench") in r.stdout, r.stdout
    # A stand-in that records its arguments and commit, as the bench writes its JSON.
    write_exe(build / "router_gemm_bench", '#!/usr/bin/env python3\nimport json, os, sys\n'
              'a = sys.argv[1:]\njson.dump({"args": a, "commit": os.environ["SMOE_COMMIT"], "device": "GPU", '
              '"reps": 3, "shapes": []}, open(a[a.index("--out") + 1], "w"))\nprint("T:d:E  variant")\n'
              'sys.exit(int(os.environ.get("FAKE_RC", "0")))\n')
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "router"], cwd=ROOT,
                       env=dict(e, ROUTER_SHAPES="100:64:8,9:16:2", ROUTER_REPS="3"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.load(open(out / "router" / "router_gemm.json"))
    assert got["commit"] == "test"
    assert got["args"][:4] == ["--reps", "3", "--shapes", "100:64:8,9:16:2"], got
    assert "T:d:E" in (out / "router" / "router_gemm.txt").read_text()
    assert (out / "router" / "router_gemm.md").read_text().startswith("router_gemm_bench on GPU at test")
    # A failed check (exit 1) still leaves the table, and fails the step.
    (out / "router" / "router_gemm.md").unlink()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "router"], cwd=ROOT,
                       env=dict(e, FAKE_RC="1"), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and (out / "router" / "router_gemm.md").exists(), r.stdout


def test_sonic_profile_stage_profiles_the_large_six_or_the_named_configs(tmp_path):
    # Dry run: the commands only (no .whl, no GPU). The profile stage names the large six by default.
    e = dict(os.environ, OUT=str(tmp_path / "out"), SMOE_COMMIT="test", DEVICE_DRY_RUN="1", SONIC_STAGE="profile")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "sonic_profile.py" in x)
    for name in ("Qwen3-Next-80B", "30B\\ n512\\ E128\\ K8", "30B\\ n256\\ E256\\ K16", "Qwen3-235B",
                 "120B\\ n1024\\ E128\\ K8", "OLMoE-7B"):
        assert name in line, line
    assert "--commit test" in line and str(tmp_path / "out" / "sonic" / "profile") in line
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT,
                       env=dict(e, SONIC_PROFILE_CONFIGS="OLMoE-7B"), capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "sonic_profile.py" in x)
    assert "--configs OLMoE-7B " in line and "Qwen3" not in line, line
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT,
                         env=dict(e, SONIC_STAGE="bogus"), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "SONIC_STAGE must be warm, run, profile or ncu" in bad.stdout
    assert "--resume" not in line
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT,
                       env=dict(e, SONIC_PROFILE_RESUME=".devrun/prev.json"), capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "sonic_profile.py" in x)
    assert line.endswith("--resume .devrun/prev.json &> " + str(tmp_path / "out" / "sonic" / "profile.log")), line


def test_sonic_ncu_stage_runs_ncu_once_per_config_and_system_then_the_report(tmp_path):
    # Dry run: one ncu run per (config, system), profiling from cudaProfilerStart only (sonic_profile.py --ncu),
    # its raw page into the manifest, and the report over the folder at the end.
    e = dict(os.environ, OUT=str(tmp_path / "out"), SMOE_COMMIT="test", DEVICE_DRY_RUN="1", SONIC_STAGE="ncu",
             SONIC_NCU_CONFIGS="OLMoE-7B,30B n256 E256 K16")
    e.pop("SONIC_NCU_METRICS", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [x for x in r.stdout.splitlines() if "sonic_profile.py" in x]
    assert len(runs) == 4, r.stdout
    for line, (cfg, system) in zip(runs, [("OLMoE-7B", "ours"), ("OLMoE-7B", "sonicmoe"),
                                          ("30B\\ n256\\ E256\\ K16", "ours"), ("30B\\ n256\\ E256\\ K16", "sonicmoe")]):
        assert " ncu --target-processes all --profile-from-start off " in line, line
        assert f"--ncu --configs {cfg} --systems {system} " in line, line
        assert "--section LaunchStats" in line and "launch__cluster_dim_x" in line, line
    d = tmp_path / "out" / "sonic" / "ncu"
    assert (d / "manifest.tsv").read_text().splitlines() == [
        "OLMoE-7B\tours\tOLMoE-7B.ours.csv", "OLMoE-7B\tsonicmoe\tOLMoE-7B.sonicmoe.csv",
        "30B n256 E256 K16\tours\t30B_n256_E256_K16.ours.csv",
        "30B n256 E256 K16\tsonicmoe\t30B_n256_E256_K16.sonicmoe.csv"]
    imports = [x for x in r.stdout.splitlines() if "--page raw" in x]
    assert len(imports) == 4 and imports[0].endswith(str(d / "OLMoE-7B.ours.csv")), imports
    last = [x for x in r.stdout.splitlines() if x.startswith("+ ")][-2]
    assert "sonic_ncu_report.py " + str(d) in last, last


def test_sonic_run_stage_passes_the_alternating_rounds_only_when_asked(tmp_path):
    # Dry run: side_by_side.py's own default (4 rounds) unless SONIC_ROUNDS names a count.
    e = dict(os.environ, OUT=str(tmp_path / "out"), SMOE_COMMIT="test", DEVICE_DRY_RUN="1", SONIC_STAGE="run")
    e.pop("SONIC_ROUNDS", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "side_by_side.py" in x)
    assert "--rounds" not in line and "--commit test" in line, line
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT,
                       env=dict(e, SONIC_ROUNDS="0"), capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "side_by_side.py" in x)
    assert "--rounds 0 " in line and "--commit test" in line, line


def test_sonic_stage_seeds_the_cards_committed_autotune_results_and_harvests_the_cache(tmp_path):
    # Dry run: the committed results of the card (SONIC_CARD stands in for nvidia-smi) are copied into
    # the quack cache before SonicMoE runs, never over what is there; the cache's results come back after.
    committed = tmp_path / "sonic_autotune"
    (committed / "h100" / "KEY").mkdir(parents=True)
    (committed / "h100" / "KEY" / "gemm.autotune.json").write_text("{}")
    e = dict(os.environ, OUT=str(tmp_path / "out"), SMOE_COMMIT="test", DEVICE_DRY_RUN="1", SONIC_STAGE="run",
             SONIC_AUTOTUNE_DIR=str(committed), SONIC_CACHE_DIR=str(tmp_path / "cache"))

    def stage(**env):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "sonic"], cwd=ROOT, env=dict(e, **env),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        run = next(i for i, x in enumerate(lines) if "side_by_side.py" in x)
        return lines, run

    lines, run = stage(SONIC_CARD="h100")
    seed = next(i for i, x in enumerate(lines) if x.startswith("+ cp -rn "))
    assert lines[seed] == f"+ cp -rn {committed}/h100/. {tmp_path / 'cache'}/", lines[seed]
    assert seed < run, "seeded after SonicMoE ran"
    harvest = next(i for i, x in enumerate(lines) if "*.autotune.json" in x)
    assert harvest > run and str(tmp_path / "out" / "sonic" / "autotune" / "h100") in lines[harvest]
    lines, _ = stage(SONIC_CARD="h200")  # no results for this card: cold, nothing copied
    assert not any(x.startswith("+ cp -rn ") for x in lines)
    assert any("no committed results for h200" in x for x in lines)
    lines, _ = stage(SONIC_CARD="h100", SONIC_AUTOTUNE_SEED="0")
    assert not any(x.startswith("+ cp -rn ") for x in lines)
    assert any("nothing copied in (SONIC_AUTOTUNE_SEED=0" in x for x in lines)


def test_a_sigkill_before_the_limit_is_not_called_a_time_out(tmp_path):
    # rc 137 from `timeout` is also what a command killed from outside returns (the host's OOM killer):
    # the step says so, with the seconds it ran, instead of "timed out".
    build = tmp_path / "build"
    build.mkdir()
    write_exe(build / "bench_layer", "#!/usr/bin/env bash\nkill -9 $$\n")
    write_exe(build / "layer_digest", '#!/usr/bin/env bash\necho "x 1"\n')
    e = dict(os.environ, BUILD=str(build), OUT=str(tmp_path / "out"), AB_CONFIGS="smoke_configs",
             AB_ROUNDS="1", SMOE_COMMIT="test", AB_VARIANTS="same:")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device.sh"), "ab"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "killed by SIGKILL after" in r.stdout, r.stdout + r.stderr
    assert "timed out" not in r.stdout


def test_the_test_step_runs_the_host_tests_on_the_gpu_too(tmp_path):
    # test_api's GPU branches (EngineApi.PrepareDoesTheLaunchSetup, ...) run only on a device.
    r = dry_run(tmp_path, "test")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    at = [next(i for i, ln in enumerate(lines) if w in ln) for w in ("test_gpu", "test_api", "smoe_main")]
    assert at == sorted(at), lines
