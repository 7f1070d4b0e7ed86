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
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "configs" / "unseen.py"), "--families", "huge",
                          "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--families" in bad.stderr
