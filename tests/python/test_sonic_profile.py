"""bench/drivers/sonic_profile.py's resume helpers (no torch, no GPU): which (config, system) tables a resumed
profile.json still lacks, and the refusal to mix commits, GPUs or --iters in one document."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sonic_profile", ROOT / "bench" / "drivers" / "sonic_profile.py")
sp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sp)


def test_pending_skips_what_the_document_holds():
    doc = {"configs": {"A": {"sonicmoe": {}, "ours": {}}, "B": {"sonicmoe": {}}}}
    assert sp.pending(doc, ["A", "B", "C"], ["sonicmoe", "ours"]) == [("B", "ours"), ("C", "sonicmoe"), ("C", "ours")]
    assert sp.pending({}, ["A"], ["ours"]) == [("A", "ours")]


def test_resumed_keeps_a_matching_document_and_refuses_another(tmp_path):
    prev = tmp_path / "profile.json"
    prev.write_text(json.dumps({"commit": "c1", "gpu": "H100", "iters": 5, "configs": {"A": {"ours": {"sum_ms": 1.0}}}}))
    doc = sp.resumed(str(prev), "c1", "H100", 5)
    assert doc["configs"]["A"]["ours"]["sum_ms"] == 1.0
    for args, what in ((("c2", "H100", 5), "its commit is 'c1', this run's 'c2'"),
                       (("c1", "H200", 5), "its gpu is 'H100', this run's 'H200'"),
                       (("c1", "H100", 3), "its iters is 5, this run's 3")):
        with pytest.raises(SystemExit) as e:
            sp.resumed(str(prev), *args)
        assert what in str(e.value)


def test_launch_order_takes_the_first_of_identical_iterations():
    events = [(30, "b", 2000.0), (10, "a", 1000.0), (50, "a", 1100.0), (70, "b", 2100.0)]
    assert sp.launch_order(events, 2) == [{"name": "a", "ms": 1.0}, {"name": "b", "ms": 2.0}]
    assert sp.launch_order(events[:3], 2) is None  # uneven: the iterations differed
    assert sp.launch_order([], 5) is None


def test_ncu_runs_one_config_and_one_system_per_process():
    import argparse
    ns = lambda **k: argparse.Namespace(**dict(dict(ncu=True, resume=None, configs="OLMoE-7B", systems="ours"), **k))
    assert sp.ncu_args_refusal(ns()) is None
    assert sp.ncu_args_refusal(ns(ncu=False, configs="a,b", systems="ours,sonicmoe")) is None
    assert "one config and one system" in sp.ncu_args_refusal(ns(configs="OLMoE-7B,30B n256 E256 K16"))
    assert "one config and one system" in sp.ncu_args_refusal(ns(systems="sonicmoe,ours"))
    assert "--resume" in sp.ncu_args_refusal(ns(resume="prev.json"))
