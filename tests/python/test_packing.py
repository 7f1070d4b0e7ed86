"""CPU tests of the packed gate/up parameters (python/smoe_torch/packing.py): no GPU, no extension.

The kernels' first-projection operand must be a view of w1/w3 (no per-step copy) when they are
packed, with the values and gradients of the torch.stack it replaces; every way the packing can be
lost (a device or dtype move, load_state_dict with assign, a replaced parameter) must either re-pack
or fall back to the copy, never give a wrong operand. Also the same moves on MoE's fp32 buffers
(expert_bias, tokens_per_expert: moe.py loaded with a stub extension).
    python3 -m pytest -q tests/python/test_packing.py
"""
import copy
import importlib.util
import io
import os
import sys

import pytest

torch = pytest.importorskip("torch")

_spec = importlib.util.spec_from_file_location(
    "smoe_packing", os.path.join(os.path.dirname(__file__), "..", "..", "python", "smoe_torch", "packing.py"))
packing = importlib.util.module_from_spec(_spec)
sys.modules["smoe_packing"] = packing  # importable by name: torch.save pickles the module's class
_spec.loader.exec_module(packing)


def stacked(w1, w3, dtype):
    """The copy the view replaces (what moe.py did before)."""
    E, n, d = w1.shape
    return torch.stack((w1.to(dtype), w3.to(dtype)), dim=2).reshape(E, 2 * n, d)


def experts(E=3, n=5, d=7, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = packing.GroupedExperts(d, n, E, pack_gate_up=True).to(dtype)
    m.init_weights(0.5)
    return m


def is_view_of_params(op, m):
    return op.data_ptr() == m.w1.data_ptr() and op.untyped_storage().data_ptr() == m.w3.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_operand_is_a_view_with_the_stacked_values(dtype):
    m = experts(dtype=dtype)
    assert packing.is_packed_pair(m.w1, m.w3)
    op = m.interleaved_w1(dtype)
    assert is_view_of_params(op, m), "no copy when packed"
    assert op.is_contiguous() and op.shape == (3, 10, 7)
    assert torch.equal(op, stacked(m.w1, m.w3, dtype))
    # Writes through the parameters (an optimizer step) show in the operand at once.
    with torch.no_grad():
        m.w3.add_(1.0)
    assert torch.equal(op, stacked(m.w1, m.w3, dtype))


def test_gradients_match_the_stack():
    m = experts(dtype=torch.float64)
    ref = experts(dtype=torch.float64)
    g = torch.randn(3, 10, 7, dtype=torch.float64)
    (m.interleaved_w1(torch.float64) * g).sum().backward()
    (stacked(ref.w1, ref.w3, torch.float64) * g).sum().backward()
    assert torch.equal(m.w1.grad, ref.w1.grad) and torch.equal(m.w3.grad, ref.w3.grad)
    assert m.w2.grad is None
    # gradcheck of the view itself (float64 halves of one packed storage).
    w1, w3 = m.w1.detach().clone().requires_grad_(), m.w3.detach().clone().requires_grad_()
    assert packing.pack_pair_(torch.nn.Parameter(w1), torch.nn.Parameter(w3))
    p1, p3 = torch.nn.Parameter(m.w1.detach().clone()), torch.nn.Parameter(m.w3.detach().clone())
    assert packing.pack_pair_(p1, p3) and packing.is_packed_pair(p1, p3)
    assert torch.autograd.gradcheck(lambda a, b: packing._InterleavedView.apply(a, b), (p1, p3))


def test_other_dtype_copies_and_still_matches():
    m = experts(dtype=torch.float32)
    op = m.interleaved_w1(torch.bfloat16)
    assert not is_view_of_params(op, m)
    assert torch.equal(op, stacked(m.w1, m.w3, torch.bfloat16))


def test_moves_and_casts_repack():
    m = experts(dtype=torch.float32)
    w1_obj = m.w1
    m = m.to(torch.bfloat16)
    assert m.w1 is w1_obj, "the Parameter objects survive (optimizers keep their references)"
    assert packing.is_packed_pair(m.w1, m.w3)
    assert is_view_of_params(m.interleaved_w1(torch.bfloat16), m)
    meta = packing.GroupedExperts(8, 4, 2, pack_gate_up=True).to("meta")
    assert not packing.is_packed_pair(meta.w1, meta.w3)
    real = meta.to_empty(device="cpu")
    assert packing.is_packed_pair(real.w1, real.w3), "to_empty re-packs"


def test_state_dict_keys_shapes_and_loads():
    m = experts(dtype=torch.float32)
    sd = m.state_dict()
    assert sorted(sd) == ["w1", "w2", "w3"] and sd["w1"].shape == (3, 5, 7) and sd["w3"].shape == (3, 5, 7)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert torch.equal(loaded["w1"], m.w1) and torch.equal(loaded["w3"], m.w3)
    # A torchtitan checkpoint: separate contiguous tensors.
    src = {k: torch.randn_like(v).contiguous() for k, v in sd.items()}
    for assign in (False, True):
        t = experts(seed=1)
        t.load_state_dict(src, assign=assign)
        assert packing.is_packed_pair(t.w1, t.w3), f"assign={assign}: packed after load"
        assert torch.equal(t.w1, src["w1"]) and torch.equal(t.w3, src["w3"]) and torch.equal(t.w2, src["w2"])
        assert torch.equal(t.interleaved_w1(torch.float32), stacked(src["w1"], src["w3"], torch.float32))


def test_deepcopy_and_pickle_repack():
    m = experts()
    for c in (copy.deepcopy(m), _pickled(m)):
        assert packing.is_packed_pair(c.w1, c.w3)
        assert c.w1.data_ptr() != m.w1.data_ptr(), "a copy, not the same memory"
        assert torch.equal(c.interleaved_w1(torch.float32), m.interleaved_w1(torch.float32))


def _pickled(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_replaced_or_unrelated_parameters_fall_back():
    m = experts()
    m.w3 = torch.nn.Parameter(torch.randn(3, 5, 7))  # by hand: not next to w1 any more
    assert not packing.is_packed_pair(m.w1, m.w3)
    op = m.interleaved_w1(torch.float32)
    assert not is_view_of_params(op, m)
    assert torch.equal(op, stacked(m.w1, m.w3, torch.float32))
    # Swapped halves, and a pair one element off, are not packed.
    m = experts()
    assert not packing.is_packed_pair(m.w3, m.w1)
    base = torch.empty(3, 5, 2, 8)
    assert not packing.is_packed_pair(base[..., 0, :7], base[..., 1, 1:])
    # Non-Parameter tensors are never re-seated.
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert not packing.pack_pair_(a, b)


def test_shared_experts_style_2d_pair():
    # nn.Linear weights [h, d] (SharedExperts): the same packing in two dimensions.
    w1 = torch.nn.Parameter(torch.randn(6, 4))
    w3 = torch.nn.Parameter(torch.randn(6, 4))
    v1, v3 = w1.detach().clone(), w3.detach().clone()
    assert packing.pack_pair_(w1, w3)
    op = packing.interleaved_pair(w1, w3, torch.float32)
    assert op.data_ptr() == w1.data_ptr() and op.shape == (12, 4)
    assert torch.equal(op, torch.stack((v1, v3), dim=1).reshape(12, 4))


def test_compiling_falls_back_to_the_stack():
    m = experts()
    f = torch.compile(lambda: m.interleaved_w1(torch.float32), backend="eager", fullgraph=True)
    assert torch.equal(f(), stacked(m.w1, m.w3, torch.float32))


def test_default_is_dense_and_fused_adamw_updates_it_right():
    """Without pack_gate_up the pair stays dense through casts, loads and copies (so torch's fused
    optimizers, which need dense parameters, take it), and a fused AdamW step equals the
    single-tensor one. The packed pair is what the CPU fused kernel gets wrong (so this can fail)."""
    torch.manual_seed(0)
    m = packing.GroupedExperts(7, 5, 3).to(torch.float64)
    m.init_weights(0.5)
    assert not packing.is_packed_pair(m.w1, m.w3) and all(p.is_contiguous() for p in m.parameters())
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    for c in (m, copy.deepcopy(m), m.to(torch.float32).to(torch.float64)):
        assert all(p.is_contiguous() for p in c.parameters())
    op1, op3 = m.gate_up_operands(torch.float64)
    assert op1.data_ptr() == m.w1.data_ptr() and op3.data_ptr() == m.w3.data_ptr(), "two tensors, no copy"

    def step(mod, fused):
        for p in mod.parameters():
            p.grad = torch.linspace(-1, 1, p.numel(), dtype=p.dtype).reshape(p.shape)
        torch.optim.AdamW(mod.parameters(), lr=0.1, fused=fused, foreach=False if not fused else None).step()
        return [p.detach().clone() for p in mod.parameters()]

    want = step(copy.deepcopy(m), fused=False)
    for a, b in zip(step(copy.deepcopy(m), fused=True), want):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _moe_without_extension():
    """python/smoe_torch/moe.py as a module of a package whose _C is an empty stub: the module can be
    built, moved, cast and updated on CPU (its forward needs the extension's ops)."""
    import importlib
    import types
    name = "smoe_moe_cpu"
    if name + ".moe" not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(os.path.dirname(__file__), "..", "..", "python", "smoe_torch")]
        stub = types.ModuleType(name + "._C")
        sys.modules[name], sys.modules[name + "._C"] = pkg, stub
        pkg._C = stub
    return importlib.import_module(name + ".moe")


def test_moe_bias_and_counts_stay_fp32_under_casts_and_follow_moves():
    """MoE(load_balance_coeff=...).to(torch.bfloat16) (or .half(), .double()) casts the parameters but
    keeps expert_bias and tokens_per_expert fp32 with their values unrounded; a device move moves them.
    The values are ones bf16 rounds (so this can fail), and update_expert_bias() on the cast module
    gives the fp32 update."""
    moe = _moe_without_extension()
    coeff = 1e-4
    m = moe.MoE(128, 64, 8, 2, load_balance_coeff=coeff)
    counts = torch.tensor([257.0, 1001.0, 3.0, 4097.0, 0.0, 12.0, 555.0, 9.0])
    bias = torch.linspace(-0.3, 0.3, 8) + 1e-3 * torch.arange(8.0)
    assert not torch.equal(counts.bfloat16().float(), counts) and not torch.equal(bias.bfloat16().float(), bias)
    m.tokens_per_expert.copy_(counts)
    m.expert_bias.copy_(bias)
    for cast, dtype in ((lambda t: t.to(torch.bfloat16), torch.bfloat16), (lambda t: t.half(), torch.float16),
                        (lambda t: t.double(), torch.float64), (lambda t: t.bfloat16(), torch.bfloat16)):
        m = cast(m)
        assert m.router.gate.weight.dtype == dtype and m.experts.w1.dtype == dtype
        assert m.tokens_per_expert.dtype == torch.float32 and m.expert_bias.dtype == torch.float32
        assert torch.equal(m.tokens_per_expert, counts) and torch.equal(m.expert_bias, bias)
    assert m.state_dict()["expert_bias"].dtype == torch.float32
    m.update_expert_bias()
    want = bias + coeff * torch.sign(counts.mean() - counts)
    want = want - want.mean()
    assert torch.equal(m.expert_bias, want) and m.tokens_per_expert.abs().sum().item() == 0
    m = m.to("meta", torch.bfloat16)
    assert m.expert_bias.device.type == "meta" and m.tokens_per_expert.device.type == "meta"
    assert m.expert_bias.dtype == torch.float32 and m.tokens_per_expert.dtype == torch.float32
    assert m.router.gate.weight.device.type == "meta" and m.router.gate.weight.dtype == torch.bfloat16
    assert moe.MoE(128, 64, 8, 2).to(torch.bfloat16).expert_bias is None  # no balancing, no buffers
