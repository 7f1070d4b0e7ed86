"""CPU test of bench/reports/gather_picks.py: the pick's regret per shape and the fastest variant per
stage and K class from a gather_sum_bench JSON.
    python3 -m pytest -q tests/python/test_gather_picks.py
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "gather_picks", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reports", "gather_picks.py"))
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


def shape(K, times, chosen, legacy=2.0, bad=()):
    vs = [{"stage": "aggregate", "variant": "legacy", "ms": legacy, "ok": True, "chosen": False}]
    vs += [{"stage": "aggregate", "variant": v, "ms": t, "ok": v not in bad, "chosen": v == chosen}
           for v, t in times.items()]
    return {"T": 100, "d": 64, "K": K, "E": 8, "copy_tbs": 3.0, "variants": vs}


def test_regret_and_class_winner():
    doc = {"results": [
        shape(1, {"1x1x4": 1.0, "1x1x8": 0.5}, "1x1x4"),            # pick 2x the fastest
        shape(1, {"1x1x4": 1.0, "1x1x8": 2.0}, "1x1x4"),            # pick the fastest
        shape(8, {"1x4x1": 1.0, "1x1x8": 0.9}, "1x4x1", bad=("1x1x8",)),  # a failed check: not a candidate
    ]}
    rows, classes = gp.analyse(doc)
    r0 = rows[0]
    assert (r0["pick"], r0["best"], r0["pick_ms"] / r0["best_ms"]) == ("1x1x4", "1x1x8", 2.0)
    assert r0["legacy_ms"] / r0["pick_ms"] == 2.0
    best, score, pick_regret, n = classes[("aggregate", "K=1")]
    # geomeans over the two K = 1 shapes: 1x1x4 -> sqrt(2 * 1), 1x1x8 -> sqrt(1 * 2): a tie, min() keeps either
    assert n == 2 and abs(score - 2 ** 0.5) < 1e-12 and abs(pick_regret - 2 ** 0.5) < 1e-12
    assert best in ("1x1x4", "1x1x8")
    best3, score3, pick3, n3 = classes[("aggregate", "K>=3")]
    assert (best3, score3, pick3, n3) == ("1x4x1", 1.0, 1.0, 1)  # the failed variant is left out
