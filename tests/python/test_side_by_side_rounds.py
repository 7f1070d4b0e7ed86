"""CPU test of bench/drivers/side_by_side.py's alternating rounds (no torch, no GPU): the order of the
systems per round, which block each timing lands in, the ratios and the table.
    python3 -m pytest -q tests/python/test_side_by_side_rounds.py
"""
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "drivers", "side_by_side.py")


@pytest.fixture(scope="module")
def sbs():
    spec = importlib.util.spec_from_file_location("side_by_side_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # torch / sonicmoe may be absent: the module records why and goes on
    return mod


def test_round_order_alternates_so_each_system_runs_first_equally_often(sbs):
    names = ["ours", "sonicmoe"]
    orders = [sbs.round_order(names, r) for r in range(4)]
    assert orders == [["ours", "sonicmoe"], ["sonicmoe", "ours"]] * 2
    assert names == ["ours", "sonicmoe"]  # the caller's list is not reversed in place
    assert sbs.round_order({"a": 1, "b": 2, "c": 3}, 1) == ["c", "b", "a"]


def test_rounds_time_each_block_in_order_and_keep_each_blocks_median(sbs):
    calls, befores = [], []

    def system(name):
        return (lambda: calls.append(f"{name}.fwd"), lambda: calls.append(f"{name}.fwd_bwd"),
                lambda: befores.append(name))

    # Block times handed out in call order: the median of each block is its middle value.
    blocks = iter([[3.0, 1.0, 2.0], [10.0, 30.0, 20.0],   # round 0: ours fwd, ours fwd_bwd
                   [5.0, 4.0, 6.0], [40.0, 50.0, 60.0],   # round 0: sonic fwd, sonic fwd_bwd
                   [7.0, 9.0, 8.0], [70.0, 80.0, 90.0],   # round 1: sonic first
                   [2.5, 2.0, 3.0], [25.0, 21.0, 22.0]])  # round 1: ours

    def timer(fn, before):
        if before is not None:
            before()
        fn()
        return next(blocks)

    per = sbs.interleaved_rounds({"ours": system("ours"), "sonicmoe": system("sonicmoe")}, 2, timer)
    assert calls == ["ours.fwd", "ours.fwd_bwd", "sonicmoe.fwd", "sonicmoe.fwd_bwd",
                     "sonicmoe.fwd", "sonicmoe.fwd_bwd", "ours.fwd", "ours.fwd_bwd"]
    assert befores == ["ours", "sonicmoe", "sonicmoe", "ours"]  # before() only ahead of the fwd_bwd blocks
    assert per == {"ours": {"fwd_ms": [2.0, 2.5], "fwd_bwd_ms": [20.0, 22.0]},
                   "sonicmoe": {"fwd_ms": [5.0, 8.0], "fwd_bwd_ms": [50.0, 80.0]}}


def test_summary_is_sonics_time_over_ours_per_round_with_the_backward_as_the_difference(sbs):
    per = {"ours": {"fwd_ms": [2.0, 4.0, 3.0], "fwd_bwd_ms": [6.0, 10.0, 9.0]},
           "sonicmoe": {"fwd_ms": [3.0, 4.0, 1.5], "fwd_bwd_ms": [7.0, 12.0, 9.0]}}
    s = sbs.interleaved_summary(per)
    assert s["fwd"]["rounds"] == pytest.approx([1.5, 1.0, 0.5])
    assert s["bwd"]["rounds"] == pytest.approx([1.0, 8.0 / 6.0, 7.5 / 6.0])
    assert s["fwd_bwd"]["rounds"] == pytest.approx([7.0 / 6.0, 1.2, 1.0])
    assert s["fwd"]["median"] == pytest.approx(1.0)
    assert (s["fwd"]["min"], s["fwd"]["max"]) == pytest.approx((0.5, 1.5))
    assert s["fwd_bwd"]["median"] == pytest.approx(7.0 / 6.0)


def test_summary_leaves_out_a_round_whose_time_of_ours_is_not_positive(sbs):
    per = {"ours": {"fwd_ms": [2.0, 5.0], "fwd_bwd_ms": [6.0, 5.0]},  # round 1: a backward of 0 ms
           "sonicmoe": {"fwd_ms": [2.0, 5.0], "fwd_bwd_ms": [8.0, 9.0]}}
    s = sbs.interleaved_summary(per)
    assert s["bwd"]["rounds"][1] is None
    assert s["bwd"]["median"] == pytest.approx(1.5) and s["bwd"]["max"] == pytest.approx(1.5)
    per["ours"]["fwd_bwd_ms"] = [2.0, 5.0]
    assert sbs.interleaved_summary(per)["bwd"]["median"] is None


def test_table_lists_the_rounds_and_a_failed_interleaved_run(sbs, tmp_path):
    ok = {"fwd_tflops": 1.0, "bwd_tflops": 1.0, "total_tflops": 1.0, "held_bytes": 1e9}
    cfg = {"T": 1024, "d": 512, "n": 256, "E": 16, "K": 8}
    summary = sbs.interleaved_summary({"ours": {"fwd_ms": [1.0, 1.0], "fwd_bwd_ms": [3.0, 3.0]},
                                       "sonicmoe": {"fwd_ms": [1.1, 0.9], "fwd_bwd_ms": [3.3, 3.0]}})
    doc = {"commit": "c", "gpu": "g", "driver": "1", "torch": "2", "date": "2026-12-08", "results": [
        {"config": {"name": "a", **cfg}, "systems": {"ours": ok, "torch_grouped_mm": ok, "sonicmoe": ok},
         "interleaved": {"rounds": 2, "reps": 10, "warmup": 2, "order": "alternating",
                         "sonicmoe_over_ours": summary}},
        {"config": {"name": "b", **cfg}, "systems": {"ours": ok, "torch_grouped_mm": ok, "sonicmoe": ok},
         "interleaved": {"error": "OutOfMemoryError: x"}},
        {"config": {"name": "c", **cfg}, "systems": {"ours": ok, "torch_grouped_mm": ok, "sonicmoe": ok}}]}
    path = tmp_path / "t.md"
    sbs.table_md(doc, str(path))
    text = path.read_text()
    # backward per round: (3.3 - 1.1) / 2 = 1.1, then (3.0 - 0.9) / 2 = 1.05: shown as min-max, not in round order
    assert "| a | 1.000 (0.900-1.100) | 1.075 (1.050-1.100) | 1.050 (1.000-1.100) |" in text
    assert "| b |" not in text.split("alternating rounds")[1].split("n/a:")[0]
    assert "- b, interleaved: OutOfMemoryError: x" in text
