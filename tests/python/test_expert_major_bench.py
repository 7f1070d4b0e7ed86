"""bench/drivers/expert_major_bench.py on the CPU (--cpu-smoke): the harness logic without a GPU or the
built extension. The smoe systems run on the float32 twin (expert_major_ref, loaded from its file), the
torch pattern on torch._grouped_mm or a per-expert loop, the token-major system on a stand-in with the
same gather / aggregation maps. Checks the routing -> expert-major rows map, the capacity layout
(segments rounded up, NaN padding never read), the correctness comparison (it passes right answers and
flags wrong ones) and the JSON / markdown it writes.
Run:  /work/venv-torch/bin/python -m pytest -q tests/python/test_expert_major_bench.py
"""
import importlib.util
import json
import pathlib
import sys
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("expert_major_bench", ROOT / "bench" / "drivers" / "expert_major_bench.py")
emb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = emb
_spec.loader.exec_module(emb)


def _problem(routing="softmax", cfg=None):
    args = SimpleNamespace(seed=0, routing=routing, align=128)
    return emb.build_problem(cfg or emb.SMOKE_CFG, args, torch.device("cpu"))


def test_routing_to_expert_major_rows():
    for routing in ("softmax", "uniform"):
        P = _problem(routing)
        assert int(P.counts.sum()) == P.R == P.T * P.K
        e_of_row = P.expert.reshape(-1)[P.order]
        assert bool((e_of_row[1:] >= e_of_row[:-1]).all()), "rows not grouped by expert"
        assert torch.equal(P.x_em.detach(), P.x_tm.detach()[P.token_of_row])
        assert torch.equal(P.probs.detach(), P.scores.detach().reshape(-1)[P.order])
        assert torch.equal(P.dout_em, P.dout_tm[P.token_of_row])
        # no token lists an expert twice (top-K without repeats)
        srt = P.expert.sort(dim=1).values
        assert bool((srt[:, 1:] != srt[:, :-1]).all())


def test_capacity_layout():
    P = _problem()
    seg = P.seg_off.long()
    sizes = seg[1:] - seg[:-1]
    assert bool((sizes % 128 == 0).all()) and bool((sizes >= P.counts.long()).all())
    assert P.R_pad == int(seg[-1]) and int(P.pad_mask.sum()) == P.R_pad - P.R > 0
    assert len(set(P.dest.tolist())) == P.R  # one slot per valid row
    e_of_row = torch.repeat_interleave(torch.arange(P.E), P.counts.long())
    assert bool((P.dest >= seg[e_of_row]).all()) and bool((P.dest < seg[e_of_row] + P.counts.long()[e_of_row]).all())
    xp = emb.padded(P.x_em.detach(), P)
    assert bool(torch.isnan(xp[P.pad_mask]).all()) and torch.equal(xp[P.dest], P.x_em.detach())


def test_compare_flags_wrong_answers():
    P = _problem()
    em, _ = emb.load_layer(False)
    S = emb.make_system("smoe_em_concat", P, em, None)
    ref, extra = emb.check_pass(S)
    checks, bad = emb.compare(ref, extra, ref, None, P)
    assert not bad and all(v == 0.0 for v in checks.values())
    wrong = dict(ref, dx_rows=ref["dx_rows"] * 1.1)
    assert any("dx_rows_vs_concat" in b for b in emb.compare(wrong, {}, ref, None, P)[1])
    nan = dict(ref, out_rows=ref["out_rows"].clone().fill_(float("nan")))
    assert any("non-finite" in b for b in emb.compare(nan, {}, ref, None, P)[1])
    assert emb.compare(ref, {"padding_max_abs": 1.0}, ref, None, P)[1]


def test_cpu_smoke_end_to_end(tmp_path):
    out, md = tmp_path / "em.json", tmp_path / "em.md"
    assert emb.main(["--cpu-smoke", "--out", str(out), "--md", str(md), "--commit", "abc123"]) == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc123" and doc["device"] == "cpu" and "--cpu-smoke" in doc["command"]
    (c,) = doc["configs"]
    assert c["R"] == c["T"] * c["K"] and set(c["systems"]) == set(emb.SYSTEMS)
    for name, m in c["systems"].items():
        assert "error" not in m, (name, m)
        assert m["rel_l2"] is not None and m["rel_l2"] <= emb.TOL, (name, m)
        assert m["fwd_ms"] > 0 and m["fwdbwd_ms"] > 0 and m["fwd_tflops"] > 0 and m["fwdbwd_tflops"] > 0
        assert {"fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwdbwd_tflops", "peak_bytes", "rel_l2"} <= set(m)
    cap = c["systems"]["smoe_em_capacity"]["checks"]
    assert cap["padding_rows"] > 0 and cap["padding_max_abs"] == 0.0
    assert "dprobs_vs_concat" in c["systems"]["smoe_token_major"]["checks"]
    assert c["systems"]["smoe_em_concat"]["saved_state_bytes"] > 0
    text = md.read_text()
    assert "| cpu-smoke | smoe_em_concat |" in text and "vs torch_grouped_mm" in text


def test_systems_subset(tmp_path):
    out = tmp_path / "sub.json"
    assert emb.main(["--cpu-smoke", "--systems", "torch_grouped_mm,smoe_em_capacity", "--out", str(out)]) == 0
    (c,) = json.loads(out.read_text())["configs"]
    assert set(c["systems"]) == {"torch_grouped_mm", "smoe_em_capacity"}
    # the reference (smoe_em_concat) is still computed, untimed, so both are checked against it
    assert "out_rows_vs_concat" in c["systems"]["torch_grouped_mm"]["checks"]


def test_cpu_path_reuses_an_imported_package_module(monkeypatch):
    """In one pytest session on a GPU machine smoe_torch is imported (the ops' fakes registered) before
    these tests run: a second copy of expert_major.py would register the fakes again, which torch refuses
    (register_fake: 'already has an fake impl registered'), so the CPU path takes the package's module."""
    import types
    imported = types.ModuleType("smoe_torch.expert_major")
    monkeypatch.setitem(sys.modules, "smoe_torch.expert_major", imported)
    mod, pkg = emb.load_layer(False)
    assert mod is imported and pkg is None
