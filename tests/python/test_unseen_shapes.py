"""bench/configs/unseen.py: a seeded draw is deterministic, differs between seeds, keeps to its
families and the layer's rules, avoids every committed shape, and respects its memory / work caps."""
import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("unseen", ROOT / "bench" / "configs" / "unseen.py")
u = importlib.util.module_from_spec(spec)
spec.loader.exec_module(u)


def shapes(doc):
    return [(c["T"], c["d"], c["n"], c["E"], c["K"]) for c in doc]


def test_deterministic_per_seed_and_new_per_seed():
    a, b, c = u.draw(7, 3), u.draw(7, 3), u.draw(8, 3)
    assert a == b
    assert shapes(a) != shapes(c)
    assert len(a) == 3 * len(u.FAMILIES)


def test_families_rules_and_caps():
    for seed in range(5):
        for cfg in u.draw(seed, 3, max_gb=30, max_tflop=20):
            T, d, n, E, K = cfg["T"], cfg["d"], cfg["n"], cfg["E"], cfg["K"]
            fam = cfg["source"].split(": ")[1]
            assert d % 64 == 0 and n % 64 == 0 and T >= 1 and 1 <= K <= E <= 512, cfg
            assert u.held_gb(T, d, n, E, K) <= 30 and u.tflop(T, d, n, E, K) <= 20, cfg
            if fam == "wide":
                assert 4096 <= d <= 8192 and 2048 <= n <= 3584 and 64 <= E <= 384
            elif fam == "odd_n":
                assert n % 256 != 0
            elif fam == "k1_few_e":
                assert E <= 16 and K == 1 and n >= 8192
            elif fam == "few_rows":
                assert T * K / E <= 129 and E >= 64
            else:
                assert fam == "general"


def test_opt_in_odd_d_family_leaves_the_default_draw_alone():
    # The default families draw what they drew before odd_d existed (a report naming its seed redraws it).
    assert "odd_d" not in u.FAMILIES
    assert shapes(u.draw(20261206, 1)) == [(8193, 4608, 3584, 128, 8), (8192, 7168, 2624, 128, 4),
                                           (65539, 4096, 8192, 16, 1), (1370, 3584, 3072, 128, 12),
                                           (2726, 2816, 1920, 64, 6)]
    doc = u.draw(11, 12, families=("odd_d",))
    assert len(doc) == 12
    for cfg in doc:
        T, d, n, E, K = cfg["T"], cfg["d"], cfg["n"], cfg["E"], cfg["K"]
        assert d % 64 == 0 and d % 256 != 0 and 1600 <= d <= 5184, cfg
        assert 1024 <= n <= 3072 and n % 64 == 0 and 16 <= E <= 128 and 2 <= K <= 8, cfg
        assert cfg["source"] == "unseen.py --seed 11: odd_d"


def test_no_committed_shape_and_names_unique():
    known = u.known_shapes()
    assert len(known) > 40  # the configs files were read
    doc = u.draw(20261206, 4)
    assert not set(shapes(doc)) & known
    assert len({c["name"] for c in doc}) == len(doc)
    # A shape the draw would give is refused once it is known.
    first = shapes(doc)[0]
    again = u.draw(20261206, 4, known=known | {first})
    assert first not in shapes(again)


def test_cli_writes_bench_layer_configs(tmp_path):
    out = tmp_path / "u.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "configs" / "unseen.py"), "--seed", "3",
                        "--per-family", "1", "--families", "wide,k1_few_e", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [c["source"].split(": ")[1] for c in doc] == ["wide", "k1_few_e"]
    assert set(doc[0]) == {"name", "T", "d", "n", "E", "K", "source"}
    odd = subprocess.run([sys.executable, str(ROOT / "bench" / "configs" / "unseen.py"), "--seed", "3",
                          "--families", "odd_d", "--per-family", "2", "--out", str(out)], capture_output=True, text=True)
    assert odd.returncode == 0, odd.stderr
    assert [c["source"].split(": ")[1] for c in json.loads(out.read_text())] == ["odd_d", "odd_d"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "configs" / "unseen.py"), "--families", "huge",
                          "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--families" in bad.stderr
