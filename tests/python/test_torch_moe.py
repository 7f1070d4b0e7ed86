"""PyTorch extension tests (GPU): ops, autograd, torch.compile, errors, state dicts, training.

Run on the H200 after `pip install --no-build-isolation .`:  python3 -m pytest -q tests/python
Everything is compared with a pure-torch float32 implementation of torchtitan's MoE at fresh
random inputs (relative L2 <= 1e-2 for bf16, as the C++ GPU tests).
"""
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: skipped")
smoe_torch = pytest.importorskip("smoe_torch")

TOL = 1e-2


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ref_moe(x, wr, w1, w2, w3, K):
    """torchtitan's MoE in float32: top-K over router logits, softmax over the K, SwiGLU experts."""
    x = x.float()
    logits = x @ wr.float().T
    vals, idx = logits.topk(K, dim=-1)
    s = vals.softmax(dim=-1)
    out = torch.zeros_like(x)
    for e in range(wr.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].float().T) * (xe @ w3[e].float().T)
        out = out.index_add(0, tok, (h @ w2[e].float().T) * s[tok, slot, None])
    return out


def draw(T, d, n, E, K, gen):
    """bf16 inputs whose K-th and (K+1)-th router logits are not near-ties (so fp32 and the
    library's cuBLAS logits pick the same experts)."""
    for _ in range(50):
        x = torch.randn(T, d, generator=gen, device="cuda").bfloat16()
        wr = (torch.randn(E, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16()
        logits = x.float() @ wr.float().T
        if K < E:
            top = logits.topk(K + 1, dim=-1).values
            # fp32 vs cuBLAS accumulation order differs by ~1e-6 here; 2e-4 is a wide margin
            if (top[:, K - 1] - top[:, K]).min() < 2e-4:
                continue
        w1 = (torch.randn(E, n, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16()
        w3 = (torch.randn(E, n, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16()
        w2 = (torch.randn(E, d, n, generator=gen, device="cuda") / math.sqrt(n)).bfloat16()
        dout = torch.randn(T, d, generator=gen, device="cuda").bfloat16()
        return x, wr, w1, w2, w3, dout
    raise RuntimeError("could not draw inputs without near-ties")


def fresh_gen():
    g = torch.Generator(device="cuda")
    g.seed()
    return g


def module_with(wr, w1, w2, w3, K):
    E, n, d = w1.shape
    m = smoe_torch.MoE(d, n, E, K, pack_gate_up=True).cuda().to(torch.bfloat16)
    m.load_state_dict({"router.gate.weight": wr, "experts.w1": w1, "experts.w2": w2, "experts.w3": w3})
    return m


SHAPES = [(512, 256, 128, 16, 4), (300, 128, 64, 8, 1), (256, 512, 256, 64, 8), (200, 128, 128, 32, 16)]


@pytest.mark.parametrize("T,d,n,E,K", SHAPES)
def test_forward_and_all_gradients_match_fp32_torch(T, d, n, E, K):
    gen = fresh_gen()
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    m = module_with(wr, w1, w2, w3, K)
    xg = x.clone().requires_grad_(True)
    out = m(xg)
    out.backward(dout)
    ref_params = [t.float().clone().requires_grad_(True) for t in (x, wr, w1, w2, w3)]
    ref = ref_moe(*ref_params, K)
    ref.backward(dout.float())
    msg = f"seed={gen.initial_seed()} shape={(T, d, n, E, K)}"
    assert rel_l2(out, ref) <= TOL, msg
    assert rel_l2(xg.grad, ref_params[0].grad) <= TOL, msg
    if K > 1:
        assert rel_l2(m.router.gate.weight.grad, ref_params[1].grad) <= TOL, msg
    else:  # softmax over one expert is constant: exactly zero router gradient
        assert m.router.gate.weight.grad.abs().max().item() == 0.0, msg
    assert rel_l2(m.experts.w1.grad, ref_params[2].grad) <= TOL, msg
    assert rel_l2(m.experts.w2.grad, ref_params[3].grad) <= TOL, msg
    assert rel_l2(m.experts.w3.grad, ref_params[4].grad) <= TOL, msg


def test_packed_expert_weights_are_read_in_place_and_match_the_copy():
    """experts.w1 / w3 share one storage, so the kernels' operand is a view (no per-step copy). A
    module whose pair is unpacked (both replaced, as FSDP's unsharded params are) passes the two
    tensors to the kernels as they are (gate/up halves, MoEWeights::w3): no copy either. Same
    results: out, dw2 and the router gradient bitwise, dw1 / dw3 to 1e-5 (the same row sums), dx
    within the bf16 bound (dX~ sums K in another order)."""
    gen = fresh_gen()
    T, d, n, E, K = 300, 128, 64, 8, 2
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    packed = module_with(wr, w1, w2, w3, K)
    ex = packed.experts
    assert ex.interleaved_w1(torch.bfloat16).data_ptr() == ex.w1.data_ptr(), "a view, not a copy"
    op1, op3 = ex.gate_up_operands(torch.bfloat16)
    assert op3 is None and op1.data_ptr() == ex.w1.data_ptr()
    loose = module_with(wr, w1, w2, w3, K)
    # FSDP2 hands both unsharded parameters over as separate contiguous tensors: no copy then. With
    # only w3 replaced, w1 is still a strided half of the old storage and is made contiguous.
    half = module_with(wr, w1, w2, w3, K).experts
    half.w3 = torch.nn.Parameter(half.w3.detach().clone())
    op1, op3 = half.gate_up_operands(torch.bfloat16)
    assert op1.is_contiguous() and torch.equal(op1, half.w1) and op3.data_ptr() == half.w3.data_ptr()
    for name in ("w1", "w3"):
        setattr(loose.experts, name, torch.nn.Parameter(getattr(loose.experts, name).detach().clone()))
    op1, op3 = loose.experts.gate_up_operands(torch.bfloat16)
    assert op1.data_ptr() == loose.experts.w1.data_ptr() and op3.data_ptr() == loose.experts.w3.data_ptr()
    res = []
    for m in (packed, loose):
        xg = x.clone().requires_grad_(True)
        out = m(xg)
        out.backward(dout)
        res.append(dict(out=out, dx=xg.grad, w1=m.experts.w1.grad, w2=m.experts.w2.grad, w3=m.experts.w3.grad,
                        wr=m.router.gate.weight.grad))
    a, b = res
    for k in ("out", "w2", "wr"):
        assert torch.equal(a[k], b[k]), k
    for k in ("w1", "w3"):
        assert rel_l2(b[k], a[k]) < 1e-5, k
    assert rel_l2(b["dx"], a["dx"]) < TOL


def test_two_tensor_ops_match_interleaved_and_compile():
    """The ops' w3 argument directly (torch.compile included): the same numbers as interleaved."""
    gen = fresh_gen()
    T, d, n, E, K = 256, 128, 128, 16, 4
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    wi = torch.stack((w1, w3), dim=2).reshape(E, 2 * n, d)
    out_i = smoe_torch.moe_forward_interleaved(x, wr, wi, w2, K)
    fn = lambda x_, g_, u_: torch.ops.smoe.moe_forward(x_, wr, g_, w2, K, u_)[0]  # noqa: E731
    for f in (fn, torch.compile(fn, fullgraph=True)):
        xg, g1, g3 = (t.clone().requires_grad_(True) for t in (x, w1, w3))
        out = f(xg, g1, g3)
        assert torch.equal(out, out_i)
        out.backward(dout)
        assert g1.grad.shape == w1.shape and g3.grad.shape == w3.shape
        wig = wi.clone().requires_grad_(True)
        smoe_torch.moe_forward_interleaved(x, wr, wig, w2, K).backward(dout)
        ref = wig.grad.view(E, n, 2, d)
        assert rel_l2(g1.grad, ref[:, :, 0]) < 1e-5 and rel_l2(g3.grad, ref[:, :, 1]) < 1e-5


def test_torch_router_logits_are_fp32_not_bf16_rounded():
    """Torch-routed paths (non-default routers, expert bias, EP) take top-K of fp32 logits from the
    bf16 GEMM, as the fused router does, not of bf16-rounded ones; gradients as the fused router's."""
    gen = fresh_gen()
    T, d, E = 512, 256, 64
    x = torch.randn(T, d, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(E, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    logits = smoe_torch.moe.router_logits(xr, w)
    assert logits.dtype == torch.float32
    ref = x.double() @ w.detach().double().T
    err, bf16_err = rel_l2(logits, ref), rel_l2(logits.bfloat16(), ref)
    assert err < 1e-5 and bf16_err > 1e-4, (err, bf16_err)
    g = torch.randn(T, E, generator=gen, device="cuda")
    logits.backward(g)
    gb = g.bfloat16().double()
    assert rel_l2(xr.grad, gb @ w.detach().double()) < TOL
    assert rel_l2(w.grad, gb.T @ x.double()) < TOL
    # The module's torch-routed path uses it: its full scores are the fp32 softmax.
    m = smoe_torch.MoE(d, 64, E, 4, score_func="sigmoid").cuda().to(torch.bfloat16)
    _, _, probs = m.router(x)
    want = torch.sigmoid(x.double() @ m.router.gate.weight.detach().double().T)
    assert rel_l2(probs, want) < 1e-5


def test_torch_compile_fullgraph_matches_eager():
    T, d, n, E, K = 256, 256, 128, 16, 4
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, fresh_gen())
    eager = module_with(wr, w1, w2, w3, K)
    compiled_m = module_with(wr, w1, w2, w3, K)
    compiled = torch.compile(compiled_m, fullgraph=True)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oe, oc = eager(xe), compiled(xc)
    oe.backward(dout)
    oc.backward(dout)
    assert rel_l2(oc, oe) <= 1e-3
    assert rel_l2(xc.grad, xe.grad) <= 1e-3
    for pe, pc in zip(eager.parameters(), compiled_m.parameters()):
        assert rel_l2(pc.grad, pe.grad) <= 1e-3


BAD_INPUTS = {
    "dtype": (lambda x, wr, w1i, w2, K: (x.float(), wr, w1i, w2, K), "x must have dtype"),
    "contiguous": (lambda x, wr, w1i, w2, K: (x.t().contiguous().t(), wr, w1i, w2, K), "x must be contiguous"),
    "device": (lambda x, wr, w1i, w2, K: (x.cpu(), wr, w1i, w2, K), "x must be a CUDA tensor"),
    "top_k": (lambda x, wr, w1i, w2, K: (x, wr, w1i, w2, 17), "top_k = 17 must be in"),
    "w2_shape": (lambda x, wr, w1i, w2, K: (x, wr, w1i, w2[:, :, :32].contiguous(), K), "w2 must be"),
    "d_multiple": (lambda x, wr, w1i, w2, K: (x[:, :96].contiguous(), wr[:, :96].contiguous(),
                                              w1i[:, :, :96].contiguous(), w2[:, :96].contiguous(), K),
                   "multiple of 64"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_raise_documented_errors(case):
    T, d, n, E, K = 64, 128, 64, 8, 2
    x, wr, w1, w2, w3, _ = draw(T, d, n, E, K, fresh_gen())
    w1i = torch.stack((w1, w3), dim=2).reshape(E, 2 * n, d)
    make, message = BAD_INPUTS[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.smoe.moe_forward(*make(x, wr, w1i, w2, K))


def test_torchtitan_state_dict_loads_unchanged():
    d, n, E, K = 128, 64, 8, 2
    m = smoe_torch.MoE(d, n, E, K)
    keys = dict(m.state_dict())
    assert set(keys) == {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}
    assert keys["router.gate.weight"].shape == (E, d)
    assert keys["experts.w1"].shape == (E, n, d) and keys["experts.w3"].shape == (E, n, d)
    assert keys["experts.w2"].shape == (E, d, n)
    sd = {k: torch.randn_like(v) for k, v in keys.items()}
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m.experts.w3, sd["experts.w3"])


def test_routing_op_matches_torch_topk():
    T, E, K = 4096, 64, 8
    logits = torch.randn(T, E, device="cuda")
    scores, topk, freq, off, scatter, rev, gather = torch.ops.smoe.topk_routing(logits, K)
    vals, idx = logits.topk(K, dim=-1)
    assert torch.equal(topk.long(), idx)
    assert torch.allclose(scores, vals.softmax(-1), atol=2e-6)
    assert torch.equal(freq.long(), torch.bincount(idx.reshape(-1), minlength=E))
    assert int(off[-1]) == T * K
    assert torch.equal(gather.long(), scatter.long() // K)


def test_aux_loss_is_differentiable():
    m = smoe_torch.MoE(128, 64, 8, 2, aux_loss_coef=0.01).cuda().bfloat16()
    x = torch.randn(256, 128, device="cuda").bfloat16()
    out = m(x)
    assert m.aux_loss is not None and m.aux_loss.requires_grad
    (out.float().square().mean() + m.aux_loss).backward()
    assert m.router.gate.weight.grad is not None


class RefMoE(torch.nn.Module):
    """Pure-torch fp32 twin of smoe_torch.MoE (same parameter names) for the training test."""

    def __init__(self, m):
        super().__init__()
        self.K = m.top_k
        self.wr = torch.nn.Parameter(m.router.gate.weight.detach().float().clone())
        self.w1 = torch.nn.Parameter(m.experts.w1.detach().float().clone())
        self.w2 = torch.nn.Parameter(m.experts.w2.detach().float().clone())
        self.w3 = torch.nn.Parameter(m.experts.w3.detach().float().clone())

    def forward(self, x):
        return ref_moe(x, self.wr, self.w1, self.w2, self.w3, self.K)


def test_tiny_model_trains_like_torch_reference():
    torch.manual_seed(torch.seed() % (2**31))
    d, n, E, K, steps = 64, 64, 8, 2, 300
    teacher = torch.randn(d, d, device="cuda") / math.sqrt(d)
    ours = smoe_torch.MoE(d, n, E, K).cuda()  # fp32 master weights, bf16 kernels
    ref = RefMoE(ours).cuda()
    opt_a = torch.optim.Adam(ours.parameters(), lr=3e-3)
    opt_b = torch.optim.Adam(ref.parameters(), lr=3e-3)
    losses_a, losses_b = [], []
    for _ in range(steps):
        x = torch.randn(512, d, device="cuda")
        y = torch.tanh(x @ teacher)
        for model, opt, losses in ((ours, opt_a, losses_a), (ref, opt_b, losses_b)):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    first = sum(losses_a[:10]) / 10
    last_a, last_b = sum(losses_a[-20:]) / 20, sum(losses_b[-20:]) / 20
    print(f"loss: start {first:.4f}, ours {last_a:.4f}, torch fp32 {last_b:.4f}")
    assert last_a < 0.5 * first
    assert abs(last_a - last_b) <= 0.15 * last_b + 1e-3


# ---- Caller-provided routing: a DeepSeek-V3-style router written in torch -------------------------
def deepseek_route(x, wr, bias, K, n_group, topk_group, scale):
    """Sigmoid scores, a load-balancing bias for selection only, group-limited top-K, the chosen
    scores renormalised and scaled (DeepSeek-V3 / Kimi-K2). Returns (expert [T,K] int64, scores)."""
    s = torch.sigmoid(x.float() @ wr.float().T)                      # [T, E], differentiable
    sel = s.detach() + bias                                          # bias: selection only
    T, E = s.shape
    g = sel.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)   # group score: top-2 sum
    keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, dim=-1).indices, 1.0)
    mask = keep.repeat_interleave(E // n_group, dim=1) > 0
    idx = sel.masked_fill(~mask, float("-inf")).topk(K, dim=-1).indices
    w = s.gather(1, idx)
    return idx, scale * w / w.sum(-1, keepdim=True)


def ref_moe_routed(x, idx, scores, w1, w2, w3):
    """fp32 experts for a given routing (idx [T,K], -1 = none), differentiable in everything."""
    x = x.float()
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].float().T) * (xe @ w3[e].float().T)
        out = out.index_add(0, tok, (h @ w2[e].float().T) * scores[tok, slot, None])
    return out


def test_deepseek_router_trains_through_provided_routing():
    gen = fresh_gen()
    T, d, n, E, K = 384, 256, 128, 32, 4
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    bias = torch.randn(E, generator=gen, device="cuda") * 0.01
    grads = {}
    for impl in ("smoe", "ref"):
        xs = x.clone().requires_grad_(True)
        wrs = wr.float().clone().requires_grad_(True)
        w1s, w2s, w3s = (w.clone().float().requires_grad_(True) for w in (w1, w2, w3))
        idx, sc = deepseek_route(xs, wrs, bias, K, n_group=8, topk_group=4, scale=2.5)
        if impl == "smoe":
            w1i = torch.stack((w1s.bfloat16(), w3s.bfloat16()), dim=2).reshape(E, 2 * n, d)
            out = smoe_torch.moe_routed(xs, w1i, w2s.bfloat16(), idx, sc)
        else:
            out = ref_moe_routed(xs, idx, sc, w1s, w2s, w3s)
        out.float().backward(dout.float())
        grads[impl] = (out.detach(), xs.grad, wrs.grad, w1s.grad, w2s.grad, w3s.grad)
    names = ("out", "dx", "dw_router", "dw1", "dw2", "dw3")
    for name, a, b in zip(names, grads["smoe"], grads["ref"]):
        assert rel_l2(a, b) < TOL, f"{name}: {rel_l2(a, b):.3e}"


def test_provided_routing_empty_slots_and_bad_ids():
    gen = fresh_gen()
    T, d, n, E, K = 200, 128, 64, 8, 3
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    w1i = torch.stack((w1, w3), dim=2).reshape(E, 2 * n, d)
    idx = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(T)])
    idx[::3, 1] = -1                      # some tokens use fewer experts
    idx[5] = -1                           # one token uses none: its output is 0
    sc = torch.rand(T, K, generator=gen, device="cuda").requires_grad_(True)
    out = smoe_torch.moe_routed(x, w1i, w2, idx, sc)
    ref = ref_moe_routed(x, idx, sc, w1, w2, w3)
    assert rel_l2(out, ref) < TOL
    assert out[5].float().abs().max().item() == 0.0
    (g,) = torch.autograd.grad(out.float(), sc, dout.float())
    (gr,) = torch.autograd.grad(ref, sc, dout.float())
    assert rel_l2(g, gr) < TOL
    assert (g[idx < 0] == 0).all(), "empty slots get zero score gradient"
    bad = idx.clone()
    bad[7, 0] = E
    with pytest.raises(ValueError, match="expert ids must be in"):
        smoe_torch.moe_routed(x, w1i, w2, bad, sc)
    dup = idx.clone()
    dup[9] = torch.tensor([2, 2, -1], device="cuda")
    with pytest.raises(ValueError, match="lists an expert twice"):
        smoe_torch.moe_routed(x, w1i, w2, dup, sc)


_M64 = (1 << 64) - 1


def _splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def ref_token_rounding(x, wr, w1, w2, w3, K, tile, rounding, seed, min_gap=1e-6):
    """Pure-torch fp32 twin of the token-rounding layer (the spec of ref::token_rounding_ref), or
    None when a kept/not-kept boundary is a near-tie that fp32 rounding could flip."""
    x = x.float()
    logits = x @ wr.float().T
    T, E = logits.shape
    S = logits.softmax(-1)
    vals, idx = logits.topk(K, dim=-1)
    topk_s = vals.softmax(-1)
    chosen = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
    Sp = (S - 1).detach().scatter(1, idx, topk_s.detach())
    kept = torch.zeros_like(chosen)
    for e in range(E):
        f = int(chosen[:, e].sum())
        rem, lo = f % tile, f - f % tile
        up = {"nr": 2 * rem > tile, "up": rem > 0, "down": False,
              "sr": rem > 0 and (_splitmix64(seed ^ _splitmix64(e)) >> 11) * 2.0 ** -53 < rem / tile}[rounding]
        keep = min(lo + tile if up else lo, T)
        v, order = Sp[:, e].sort(descending=True, stable=True)
        if 0 < keep < T and (v[keep - 1] - v[keep]).item() < min_gap:
            return None
        kept[order[:keep], e] = True
    W = torch.where(chosen, torch.zeros_like(S).scatter(1, idx, topk_s), S) * kept
    out = torch.zeros_like(x)
    for e in range(E):
        tok = kept[:, e].nonzero()[:, 0]
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].float().T) * (xe @ w3[e].float().T)
        out = out.index_add(0, tok, (h @ w2[e].float().T) * W[tok, e, None])
    return out, kept


@pytest.mark.parametrize("rounding", ["nr", "up", "down", "sr"])
def test_token_rounding_matches_fp32_torch_twin(rounding):
    gen = fresh_gen()
    T, d, n, E, K = 1000, 128, 128, 16, 2   # ~125 rows per expert against the 128 tile
    tile = smoe_torch._C.token_rounding_tile()
    for _ in range(20):
        x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
        leaves = [t.clone().float().requires_grad_(True) for t in (x, wr, w1, w2, w3)]
        r = ref_token_rounding(*leaves, K, tile, rounding, seed=3)
        if r is not None:
            break
    else:
        pytest.fail("could not draw inputs without near-ties at a rounding boundary")
    ref, kept = r
    ref.backward(dout.float())
    counts = kept.sum(0)
    assert bool(((counts % tile == 0) | (counts == T)).all()), "twin: rounded counts must sit on the tile"
    w1i = torch.stack((w1, w3), dim=2).reshape(E, 2 * n, d)
    xs, wrs, w1s, w2s = (t.clone().requires_grad_(True) for t in (x, wr, w1i, w2))
    out = smoe_torch.moe_token_rounding(xs, wrs, w1s, w2s, K, rounding, seed=3)
    out.float().backward(dout.float())
    g1 = w1s.grad.view(E, n, 2, d)
    pairs = [("out", out, ref), ("dx", xs.grad, leaves[0].grad), ("dw_router", wrs.grad, leaves[1].grad),
             ("dw1", g1[:, :, 0], leaves[2].grad), ("dw3", g1[:, :, 1], leaves[4].grad), ("dw2", w2s.grad, leaves[3].grad)]
    for name, a, b in pairs:
        assert rel_l2(a, b) < TOL, f"{name}: {rel_l2(a, b):.3e}"


def test_module_router_variants_match_torch_twin():
    gen = fresh_gen()
    T, d, n, E, K = 256, 128, 64, 16, 4
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    variants = [dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, route_scale=2.5,
                     load_balance_coeff=1e-3),
                dict(score_func="softmax", route_norm=False),          # OLMoE: no renormalisation
                dict(score_func="softmax", bf16_logits=True)]          # top-K of bf16 logits
    for kw in variants:
        m = smoe_torch.MoE(d, n, E, K, **kw).cuda().to(torch.bfloat16)
        m.load_state_dict({"router.gate.weight": wr, "experts.w1": w1, "experts.w2": w2, "experts.w3": w3,
                           **({"expert_bias": torch.zeros(E, device="cuda")} if "load_balance_coeff" in kw else {})})
        xs = x.clone().requires_grad_(True)
        out = m(xs)
        out.float().backward(dout.float())
        # Twin: the module's own torch router at fp32 weights (same decisions), fp32 experts.
        xr = x.clone().float().requires_grad_(True)
        idx, sc, _ = m.router(x, m.expert_bias, kw.get("bf16_logits", False))
        ref = ref_moe_routed(xr, idx.long(), sc.detach(), w1, w2, w3)
        ref.backward(dout.float())
        assert rel_l2(out, ref) < TOL, kw
        assert m.experts.w2.grad is not None and m.router.gate.weight.grad is not None
        if "load_balance_coeff" in kw:
            assert m.tokens_per_expert.sum().item() == T * K
            m.update_expert_bias()
            assert m.expert_bias.abs().sum().item() > 0 and m.tokens_per_expert.sum().item() == 0


def test_shared_experts_and_aux_loss_from_routing_counts():
    gen = fresh_gen()
    T, d, n, E, K = 256, 128, 64, 16, 2
    x, wr, w1, w2, w3, dout = draw(T, d, n, E, K, gen)
    m = smoe_torch.MoE(d, n, E, K, aux_loss_coef=0.01, num_shared_experts=2).cuda().to(torch.bfloat16)
    sd = {"router.gate.weight": wr, "experts.w1": w1, "experts.w2": w2, "experts.w3": w3}
    hs = 2 * n
    ws = [(torch.randn(hs, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16(),
          (torch.randn(d, hs, generator=gen, device="cuda") / math.sqrt(hs)).bfloat16(),
          (torch.randn(hs, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16()]
    sd.update({"shared_experts.w1.weight": ws[0], "shared_experts.w2.weight": ws[1], "shared_experts.w3.weight": ws[2]})
    m.load_state_dict(sd)
    xs = x.clone().requires_grad_(True)
    out = m(xs)
    (out.float() * dout.float()).sum().backward()
    xf = x.float()
    shared = (F.silu(xf @ ws[0].float().T) * (xf @ ws[2].float().T)) @ ws[1].float().T
    ref = ref_moe(x, wr, w1, w2, w3, K) + shared
    assert rel_l2(out, ref) < TOL
    assert m.shared_experts.w2.weight.grad is not None and m.shared_experts.w2.weight.grad.abs().sum() > 0
    # The aux loss uses the routing's own counts: equal to recomputing the top-K in torch.
    logits = xf @ wr.float().T
    probs = logits.softmax(-1)
    f = torch.bincount(logits.topk(K, dim=-1).indices.reshape(-1), minlength=E).float() / (T * K)
    expect = 0.01 * E * (f * probs.mean(0)).sum()
    assert abs(m.aux_loss.item() - expect.item()) < 1e-3 * expect.item() + 1e-6


def test_zero_tokens_through_every_op():
    d, n, E, K = 128, 64, 8, 2
    x = torch.empty(0, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wr = torch.randn(E, d, device="cuda").bfloat16().requires_grad_(True)
    w1 = torch.randn(E, 2 * n, d, device="cuda").bfloat16().requires_grad_(True)
    w2 = torch.randn(E, d, n, device="cuda").bfloat16().requires_grad_(True)
    for name, fn in [("top-K", lambda: smoe_torch.moe_forward_interleaved(x, wr, w1, w2, K)),
                     ("token rounding", lambda: smoe_torch.moe_token_rounding(x, wr, w1, w2, K, "up")),
                     ("provided", lambda: smoe_torch.moe_routed(
                         x, w1, w2, torch.empty(0, K, dtype=torch.int32, device="cuda"),
                         torch.empty(0, K, device="cuda"), validate=True))]:
        out = fn()
        assert out.shape == (0, d), name
        gw1, gw2 = torch.autograd.grad(out.float().sum(), (w1, w2), allow_unused=True)
        assert gw1 is not None and gw1.abs().sum().item() == 0, name
        assert gw2 is not None and gw2.abs().sum().item() == 0, name


def _saved_state_case(op, T, d, n, E, K):
    """Inputs of one smoe forward op (gate/up as two tensors), its leaves, and two closures: forward()
    (a fresh autograd graph: (out, saved)) and direct(saved) (the matching backward op called on the
    plain tensors, keeping the state)."""
    gen = fresh_gen()  # no reference here, so near-tie logits do not matter (draw() would reject most)
    x, dout = (torch.randn(T, d, generator=gen, device="cuda").bfloat16() for _ in range(2))
    wr = (torch.randn(E, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16()
    w1, w3 = ((torch.randn(E, n, d, generator=gen, device="cuda") / math.sqrt(d)).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, d, n, generator=gen, device="cuda") / math.sqrt(n)).bfloat16()
    leaves = [t.clone().requires_grad_(True) for t in (x, wr, w1, w2, w3)]
    xl, wrl, w1l, w2l, w3l = leaves
    if op == "moe_forward_routed":
        logits = x.float() @ wr.float().T
        vals, expert = logits.topk(K, dim=-1)
        scores = vals.softmax(dim=-1).requires_grad_(True)
        expert = expert.to(torch.int32)
        leaves = [xl, w1l, w2l, w3l, scores]
        forward = lambda: torch.ops.smoe.moe_forward_routed(xl, w1l, w2l, expert, scores, w3l)  # noqa: E731
        direct = lambda saved: torch.ops.smoe.moe_backward_routed(dout, x, w1, w2, saved, K, w3)  # noqa: E731
    elif op == "moe_forward_tr":
        forward = lambda: torch.ops.smoe.moe_forward_tr(xl, wrl, w1l, w2l, K, 1, 7, w3l)  # noqa: E731
        direct = lambda saved: torch.ops.smoe.moe_backward_tr(dout, x, wr, w1, w2, saved, K, 1, w3)  # noqa: E731
    else:
        forward = lambda: torch.ops.smoe.moe_forward(xl, wrl, w1l, w2l, K, w3l)  # noqa: E731
        direct = lambda saved: torch.ops.smoe.moe_backward(dout, x, wr, w1, w2, saved, K, w3)  # noqa: E731
    return leaves, dout, forward, direct


def _peak_over_now(fn):
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kept = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - now, kept


@pytest.mark.parametrize("op", ["moe_forward", "moe_forward_tr", "moe_forward_routed"])
def test_backward_allocates_no_gradient_for_the_saved_state(op, monkeypatch):
    """The saved state (an output) takes no gradient (_ops._saved_takes_no_grad): the autograd backward
    needs no more memory than the backward op called directly. Before, the engine allocated and
    zero-filled a tensor of the saved state's size (4TKn bytes) on every backward; this shape makes that
    the larger of the two by far (saved 67 MB against 2 MB per weight), so the check fails then. The
    autograd backward keeps the state here (consume_saved off) to compare like with like."""
    monkeypatch.setattr(smoe_torch._ops, "_CONSUME_OFF", True)
    leaves, dout, forward, direct = _saved_state_case(op, 8192, 256, 512, 8, 4)
    out, saved = forward()
    by_op, grads = _peak_over_now(lambda: direct(saved))
    del grads
    by_autograd, _ = _peak_over_now(lambda: out.backward(dout))
    assert all(t.grad is not None for t in leaves)
    assert by_autograd - by_op < saved.numel() // 2, (op, by_autograd, by_op, saved.numel())


@pytest.mark.parametrize("op", ["moe_forward", "moe_forward_tr", "moe_forward_routed"])
def test_backward_consumes_the_saved_state_only_when_autograd_frees_it(op, monkeypatch):
    """_ops._consume_saved: an eager backward without retain_graph writes dH over the saved H
    (MoEBackwardArgs::consume_saved). Its gradients are bitwise those of the backward that keeps the state,
    at H's bytes (R x 2n bf16, R >= TK) less peak. With retain_graph the state is kept: a second backward
    on the same graph gives the same gradients again (a spent state would give NaN and raise at
    raise_if_nonfinite's check of the status)."""
    T, d, n, E, K = 4096, 256, 512, 8, 4
    leaves, dout, forward, _ = _saved_state_case(op, T, d, n, E, K)

    def backward(consume_off, retain=False, out=None):
        monkeypatch.setattr(smoe_torch._ops, "_CONSUME_OFF", consume_off)
        for t in leaves:
            t.grad = None
        out = forward()[0] if out is None else out
        peak, _ = _peak_over_now(lambda: out.backward(dout, retain_graph=retain))
        return [t.grad.clone() for t in leaves], peak, out

    kept, peak_kept, _ = backward(consume_off=True)
    spent, peak_spent, _ = backward(consume_off=False)
    for i, (a, b) in enumerate(zip(kept, spent)):
        assert torch.equal(a, b), f"{op}: gradient {i} differs when the saved state is consumed"
    h_bytes = T * K * 2 * n * 2
    assert peak_kept - peak_spent >= 0.95 * h_bytes, (op, peak_kept, peak_spent, h_bytes)

    smoe_torch.reset_nonfinite_status()
    first, _, out = backward(consume_off=False, retain=True)
    second, _, _ = backward(consume_off=False, out=out)
    smoe_torch.raise_if_nonfinite()
    for i, (a, b, c) in enumerate(zip(kept, first, second)):
        assert torch.equal(a, b) and torch.equal(a, c), f"{op}: gradient {i} after retain_graph"


def test_nonfinite_logits_raise_and_reset():
    T, d, n, E, K = 64, 128, 64, 8, 2
    x = torch.randn(T, d, device="cuda").bfloat16()
    wr = torch.randn(E, d, device="cuda").bfloat16()
    w1 = torch.randn(E, 2 * n, d, device="cuda").bfloat16() * 0.05
    w2 = torch.randn(E, d, n, device="cuda").bfloat16() * 0.05
    smoe_torch.reset_nonfinite_status()
    smoe_torch.moe_forward_interleaved(x, wr, w1, w2, K)
    smoe_torch.raise_if_nonfinite()          # clean: no raise
    x[17, 3] = float("nan")
    smoe_torch.moe_forward_interleaved(x, wr, w1, w2, K)
    with pytest.raises(FloatingPointError, match="first is token 17"):
        smoe_torch.raise_if_nonfinite()
    smoe_torch.raise_if_nonfinite()          # the record was reset by the raise above


def test_fake_saved_size_matches_the_library():
    for T in (0, 1, 7, 128, 1000, 4099):
        for (n, E, K) in ((64, 8, 2), (256, 128, 8), (128, 512, 16)):
            for router, rounding in ((0, 0), (2, 0), (1, 0), (1, 1), (1, 2), (1, 3)):
                assert smoe_torch.saved_state_bytes(T, n, E, K, router, rounding) == \
                    smoe_torch._C.saved_state_size(T, 128, n, E, K, router, rounding), (T, n, E, K, router, rounding)


def test_torch_compile_dynamic_compiles_once_over_T():
    import torch._dynamo
    torch._dynamo.reset()
    m = smoe_torch.MoE(128, 64, 8, 2).cuda().to(torch.bfloat16)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    f = torch.compile(m, dynamic=True, backend=backend)
    for T in (130, 257, 600, 1000):
        x = torch.randn(T, 128, device="cuda").bfloat16().requires_grad_(True)
        out = f(x)
        ref = m(x.detach())
        assert rel_l2(out, ref) < 1e-6, T   # same kernels, bitwise-equal up to nothing
        out.float().sum().backward()
    assert len(frames) == 1, f"recompiled: {len(frames)} graphs for 4 sequence lengths"


def test_topk_routing_op_checks_top_k_before_casting():
    logits = torch.randn(16, 8, device="cuda")
    with pytest.raises(RuntimeError, match="top_k = 4294967298"):
        torch.ops.smoe.topk_routing(logits, 2 ** 32 + 2)


@pytest.mark.parametrize("kw, mentions", [
    (dict(dim=100), "dim = 100"),
    (dict(hidden_dim=96), "hidden_dim = 96"),
    (dict(num_experts=0), "num_experts = 0"),
    (dict(num_experts=513), "num_experts = 513"),
    (dict(top_k=0), "top_k = 0"),
    (dict(top_k=9, num_experts=8), "top_k = 9"),
    (dict(top_k=17, num_experts=64), "top_k = 17"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
    (dict(load_balance_coeff=-1e-3), "load_balance_coeff"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(token_rounding="bogus"), "token_rounding must be"),
    (dict(token_rounding="bogus", score_func="sigmoid"), "token_rounding must be"),  # the value before the router rule
])
def test_module_arguments_checked_at_construction(kw, mentions):
    args = dict(dim=128, hidden_dim=64, num_experts=8, top_k=2)
    args.update(kw)
    with pytest.raises(ValueError, match=mentions):
        smoe_torch.MoE(**args)


def test_wrong_input_width_names_the_expected_dim():
    m = smoe_torch.MoE(128, 64, 8, 2).cuda()
    x = torch.randn(4, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dim = 128"):
        m(x)


def test_eval_counts_nothing_and_does_no_token_rounding():
    torch.manual_seed(0)
    d, n, E, K, T = 128, 64, 8, 2, 300
    # expert_bias counting and the aux loss only in training
    m = smoe_torch.MoE(d, n, E, K, load_balance_coeff=1e-3, aux_loss_coef=1e-2).cuda()
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    m.train()
    m(x)
    counted = m.tokens_per_expert.clone()
    assert counted.sum().item() == T * K and m.aux_loss is not None
    m.eval()
    with torch.no_grad():
        m(x)
    assert torch.equal(m.tokens_per_expert, counted) and m.aux_loss is None
    # token rounding trains with TR and evaluates with plain top-K: the same output as a top-K module
    tr = smoe_torch.MoE(d, n, E, K, token_rounding="nr").cuda()
    topk = smoe_torch.MoE(d, n, E, K).cuda()
    topk.load_state_dict(tr.state_dict())
    tr.eval()
    topk.eval()
    with torch.no_grad():
        assert torch.equal(tr(x), topk(x))
        tr.train()
        assert not torch.equal(tr(x), topk(x))  # T*K = 600 rows over 8 experts: TR changes the rows


@pytest.mark.parametrize("reentrant", [False, True])
def test_expert_bias_counts_once_under_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    d, n, E, K, T = 128, 64, 8, 2, 256
    m = smoe_torch.MoE(d, n, E, K, load_balance_coeff=1e-3).cuda()
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
    out.float().sum().backward()  # the recompute inside backward must not count again
    assert m.tokens_per_expert.sum().item() == T * K
    assert x.grad is not None and m.router.gate.weight.grad is not None


_DP_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
import smoe_torch
rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
m = smoe_torch.MoE(128, 64, 8, 2, load_balance_coeff=0.1)
m.tokens_per_expert.copy_(torch.arange(8, dtype=torch.float32) * (1 + 3 * rank))  # different local loads
m.update_expert_bias()
print(json.dumps({"bias": m.expert_bias.tolist(), "tpe": m.tokens_per_expert.tolist()}))
dist.destroy_process_group()
"""


def test_update_expert_bias_all_reduces_over_data_parallel_ranks(tmp_path):
    """Two data-parallel ranks (gloo, CPU buffers) with different local counts make one update."""
    import json
    import subprocess
    import sys
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", _DP_SCRIPT, str(r), "2", str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    res = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        res.append(json.loads(out.strip().splitlines()[-1]))
    assert res[0]["bias"] == res[1]["bias"]
    total = torch.arange(8, dtype=torch.float32) * (1 + 4)  # rank 0 x1 + rank 1 x4
    want = 0.1 * torch.sign(total.mean() - total)
    want = want - want.mean()
    assert torch.allclose(torch.tensor(res[0]["bias"]), want)
    assert res[0]["tpe"] == [0.0] * 8  # counts reset after the update


def _ops_run_in(fn):
    """Schema names of the ops that reach the dispatcher's Python modes while fn() runs. Not the
    profiler: it records an op that selective checkpointing then serves from its cache. The backward
    runs on this thread (multithreading off), where the counting mode is pushed; checkpointing's own
    mode is pushed later, so it answers first and a cached op never gets here."""
    from torch.utils._python_dispatch import TorchDispatchMode
    names = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with torch.autograd.set_multithreading_enabled(False), Count():
        fn()
    return names


@pytest.mark.parametrize("layer", ["module", "expert_major"])
def test_selective_checkpoint_keeps_the_smoe_ops_and_recomputes_the_rest(layer):
    """smoe_torch.checkpoint.context_fn(): the backward of a checkpointed block runs no smoe forward op
    (its outputs were saved) but recomputes the dense projection, and the gradients are bitwise those
    of the block without checkpointing. Plain checkpointing reruns the smoe op (so the check can fail)."""
    from torch.utils.checkpoint import checkpoint
    import smoe_torch.checkpoint as sc
    torch.manual_seed(0)
    d, n, E, K, T = 128, 64, 8, 2, 256
    lin = torch.nn.Linear(d, d, bias=False).cuda().bfloat16()
    if layer == "module":
        m = smoe_torch.MoE(d, n, E, K, load_balance_coeff=1e-3).cuda()
        op = "smoe::moe_forward_routed"  # expert_bias: the router runs in torch, the experts on provided routing
        params = [lin.weight, m.router.gate.weight, m.experts.w1, m.experts.w2, m.experts.w3]

        def block(x):
            return m(lin(x))
    else:
        w1 = (torch.randn(E, 2 * n, d, device="cuda") / math.sqrt(d)).bfloat16().requires_grad_(True)
        w2 = (torch.randn(E, d, n, device="cuda") / math.sqrt(n)).bfloat16().requires_grad_(True)
        counts = torch.tensor([40, 0, 33, 100, 1, 50, 12, 20], dtype=torch.int32, device="cuda")
        op = "smoe::expert_major_fwd"
        params = [lin.weight, w1, w2]

        def block(x):
            return smoe_torch.expert_major(lin(x), counts, w1, w2)
    x0 = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x0)

    def run(context_fn):
        x = x0.clone().requires_grad_(True)
        for p in params:
            p.grad = None
        if context_fn == "none":
            y = block(x)
        elif context_fn == "plain":
            y = checkpoint(block, x, use_reentrant=False)
        else:
            y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        names = _ops_run_in(lambda: y.backward(dout))
        return [y.detach(), x.grad] + [p.grad for p in params], names

    want, names_none = run("none")
    got, names_sac = run(sc.context_fn())
    _, names_plain = run("plain")
    assert op not in names_none and op not in names_sac, "the backward of the selective checkpoint reran the layer"
    assert op in names_plain, "plain checkpointing should rerun the layer (else this test cannot fail)"
    mm = "aten::mm"
    assert names_sac.count(mm) > names_none.count(mm), "the dense projection was not recomputed"
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if layer == "module":
        assert m.tokens_per_expert.sum().item() == 3 * T * K  # three forwards, each counted once


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_on_the_module_updates_like_dense_params(impl, pack):
    """An AdamW step (torch's foreach and fused CUDA kernels; fused is torchtitan's default) on the
    module equals the same step on dense copies. pack_gate_up=True makes w1 / w3 strided halves of one
    storage: fused AdamW refuses those (measured on the H200 at 29ae5a4), which is why packing is
    opt-in; foreach takes them."""
    torch.manual_seed(0)
    m = smoe_torch.MoE(128, 64, 8, 2, num_shared_experts=1, pack_gate_up=pack).cuda()
    assert m.experts.w1.is_contiguous() != pack
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(256, 128, device="cuda")
    m(x).float().square().mean().backward()
    dense = [torch.nn.Parameter(p.detach().clone().contiguous()) for p in m.parameters()]
    for q, p in zip(dense, m.parameters()):
        q.grad = p.grad.detach().clone().contiguous()
    torch.optim.AdamW(dense, lr=1e-2, **{impl: True}).step()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, **{impl: True})
    if pack and impl == "fused":
        with pytest.raises(RuntimeError, match="same dtype, device, and layout"):
            opt.step()
        return
    opt.step()
    for n, p, q in zip(names, m.parameters(), dense):
        assert torch.equal(p.detach(), q.detach()), f"{impl} AdamW: {n} differs from the dense step"
