"""torch.compile(fullgraph=True) on every router path of smoe_torch.MoE (GPU; issue 38, item 2).

test_torch_moe.py compiles only the default module, with the fused softmax router. MoE.forward has more
branches, and each traces differently:
* the token-rounding op;
* the router in torch: sigmoid, no renormalisation, a scale, group-limited top-K, bf16 logits, the
  expert bias;
* the buffer mutation that counts tokens for the bias;
* the aux loss, taken from the routing's own counts when the fused router runs;
* shared experts;
* the train / eval rules.
For each path the test compiles the module (default inductor backend, fullgraph=True, so a graph
break fails instead of silently running eager). It runs two training steps at fresh random inputs and
compares with eager:
* the forward output;
* the gradients of x and of every parameter (the loss includes the aux loss);
* with an expert bias, the token counts, and the bias after update_expert_bias(). The test changes
  the bias between the steps, so the compiled graph must read the buffer and not a constant baked in
  when tracing.

Tolerances:
* Bitwise where the library's kernels choose the experts and nothing else runs in torch (the fused
  router, token rounding). Eager and compiled then run the same deterministic ops on the same operands.
  test_expert_major.py's compile test makes the same bitwise check for its own op.
* Otherwise inductor recomputes the router and the aux loss in its own order: relative L2 <= 1e-3,
  test_torch_moe.py's compile tolerance.
* TOL (1e-2, the bf16 bound, as test_torch_moe.py uses for dx of packed against unpacked weights) for
  sums of bf16 partial gradients. Eager rounds each partial sum to bf16; inductor folds the sum into
  one addmm or fused add and rounds once, which moves an element by up to a bf16 ulp. This covers dx
  (the experts', the router GEMM's and the shared experts' parts) and the router gradient when the aux
  loss reruns the router GEMM.
* The bf16-logit paths compile with torch._inductor.config.emulate_precision_casts=True. Inductor's
  default elides the bf16 round trip of the bf16 softmax, so compiled scores are unrounded. The route
  weights then move by up to half an ulp, and the router gradient can move much further: eager rounds
  the score gradient to bf16 before the bf16 softmax backward, which cancels. With emulation inductor
  keeps eager's roundings. test_bf16_logits_under_default_inductor_numerics checks what the default
  still guarantees: the same experts and counts, and the output within TOL.

The modules keep the dense gate/up parameters (pack_gate_up=False, the default). With packing, eager
reads an interleaved view and the compiled graph reads the two tensors (packing.py); that case is in
test_torch_moe.py and is not a router path.

Routing decisions must not depend on last bits. With the router in torch, the test redraws input rows
until every token's decisions are apart by more than the two implementations can differ: the K-th
against the (K+1)-th selection score, and with groups also the last kept group against the first
dropped one. Each score gets an uncertainty, 5e-5 with fp32 logits and 3 bf16 ulps with bf16 logits,
and the two sides of a decision must be further apart than the sum of theirs. Eager and compiled then
choose the same experts and count the same tokens. Stochastic rounding ("sr") uses the same seed in
both modules.

Not here: ep_group, which needs 2 GPUs (tests/python/test_ep.py).
Run on the H200 after `pip install --no-build-isolation .`:
    cd /tmp && python3 -m pytest -q <repo>/tests/python/test_compile_router_paths.py
"""
import contextlib
import math
import pathlib
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: skipped")
smoe_torch = pytest.importorskip("smoe_torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_torch_moe import TOL, draw, fresh_gen, rel_l2  # noqa: E402  (the shared helpers)

COMPILE_TOL = 1e-3  # test_torch_moe.py::test_torch_compile_fullgraph_matches_eager
D, N, E, K = 256, 128, 16, 4
BIAS_STD = 0.01     # moves some tokens' choice

# id -> MoE keyword arguments ("params": the parameter dtype, bf16 unless given). Each names the
# branch of MoE.forward / TokenChoiceTopKRouter.forward it takes.
PATHS = {
    "fused_softmax": {},                                              # the library's router (default)
    "tr_nr": dict(token_rounding="nr"),                               # moe_forward_tr, each mode
    "tr_up": dict(token_rounding="up"),
    "tr_down": dict(token_rounding="down"),
    "tr_sr": dict(token_rounding="sr", rounding_seed=12345),          # same seed in eager and compiled
    "sigmoid": dict(score_func="sigmoid"),                            # the router in torch from here on
    "softmax_no_norm": dict(route_norm=False),                        # OLMoE: no renormalisation
    "route_scale": dict(route_scale=2.5),
    "groups": dict(num_expert_groups=4, num_limited_groups=2),        # group-limited top-K
    "bf16_logits": dict(bf16_logits=True),                            # top-K of bf16 logits
    "expert_bias": dict(load_balance_coeff=1e-3),                     # softmax + selection bias + counting
    "bf16_logits_bias": dict(bf16_logits=True, load_balance_coeff=1e-3),
    "aux_fused": dict(aux_loss_coef=1e-2),                            # aux loss from the kernel's counts
    "aux_tr": dict(token_rounding="up", aux_loss_coef=1e-2),          # ... of a token-rounding forward
    "aux_torch": dict(score_func="sigmoid", aux_loss_coef=1e-2),      # aux loss from torch routing
    "bias_aux": dict(load_balance_coeff=1e-3, aux_loss_coef=1e-2),    # one bincount for both
    "shared_fused": dict(num_shared_experts=2),                       # shared experts + fused router
    "deepseek_v3": dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, route_scale=2.5,
                        load_balance_coeff=1e-3, num_shared_experts=1),
    "fp32_params_fused": dict(params=torch.float32),                  # fp32 master weights: casts in the graph
    "fp32_params_bias": dict(params=torch.float32, load_balance_coeff=1e-3),  # ... with the expert bias
}
# The paths where eval differs from training: no counting, no aux loss, plain top-K instead of TR.
EVAL_RULE_PATHS = [p for p, kw in PATHS.items()
                   if kw.get("token_rounding") or kw.get("load_balance_coeff") is not None
                   or kw.get("aux_loss_coef", 0) > 0]


def tokens():
    """T = one GEMM tile of rows per expert on average (512 with the 128-row tile), so that token
    rounding moves rows both ways. At a far smaller T most experts would round to 0 rows."""
    return smoe_torch._C.token_rounding_tile() * E // K


def torch_routed(m):
    """MoE.forward's own rule: the router runs in torch; otherwise the fused kernel chooses the experts."""
    return not m.router.fused() or m.bf16_logits or m.expert_bias is not None


def bitwise(m):
    """Only the smoe ops and reshapes / casts are in the graph, so eager and compiled are bitwise equal."""
    return not torch_routed(m) and m.aux_loss_coef == 0 and m.shared_experts is None


def tolerance(m, name):
    """The bound on compiled against eager for the tensor `name` of module m ("out", "x", "aux_loss"
    or a parameter name). 0 means bitwise. The module docstring gives the reasons."""
    if bitwise(m):
        return 0.0
    if name == "x":
        return TOL  # a sum of bf16 partial gradients: inductor rounds it once, eager at each step
    if name == "router.gate.weight" and m.aux_loss_coef > 0 and not torch_routed(m):
        return TOL  # the routing GEMM's gradient plus the aux loss's router GEMM's
    if m.bf16_logits:
        # Scores from bf16 logits and the logits' gradient are rounded to bf16 (2^-9 relative) where
        # inductor and eager cast at different points, even with emulate_precision_casts: on the H100
        # at 857f02e / 54a3cd5 the router weight's gradient differed by 3.5e-3 and an eval output by
        # 2.2e-3, inside one bf16 rounding. The experts chosen are the same (the margins above).
        return TOL
    return COMPILE_TOL


def numerics(m):
    """The inductor config to compile m under: eager's bf16 roundings kept on the bf16-logit paths."""
    if m.bf16_logits:
        import torch._inductor.config
        return torch._inductor.config.patch(emulate_precision_casts=True)
    return contextlib.nullcontext()


def build_pair(path, gen):
    """(eager, twin, x, dout): two modules with the same fresh random weights (routed experts, router,
    shared experts, a nonzero expert bias). The twin is the one to compile."""
    kw = dict(PATHS[path])
    dtype = kw.pop("params", torch.bfloat16)
    T = tokens()
    x, wr, w1, w2, w3, dout = draw(T, D, N, E, K, gen)
    eager = smoe_torch.MoE(D, N, E, K, **kw).cuda().to(dtype)
    sd = {"router.gate.weight": wr, "experts.w1": w1, "experts.w2": w2, "experts.w3": w3}
    if eager.shared_experts is not None:
        h = eager.shared_experts.w1.weight.shape[0]
        for name, shape, fan_in in (("w1", (h, D), D), ("w2", (D, h), h), ("w3", (h, D), D)):
            w = torch.randn(*shape, generator=gen, device="cuda") / math.sqrt(fan_in)
            sd[f"shared_experts.{name}.weight"] = w.bfloat16()
    if eager.expert_bias is not None:  # fp32 buffers whatever the parameters' dtype (MoE._apply)
        assert eager.expert_bias.dtype == eager.tokens_per_expert.dtype == torch.float32
        sd["expert_bias"] = torch.randn(E, generator=gen, device="cuda") * BIAS_STD
    eager.load_state_dict(sd)
    twin = smoe_torch.MoE(D, N, E, K, **kw).cuda().to(dtype)
    twin.load_state_dict(eager.state_dict())
    assert eager.training and twin.training
    return eager, twin, x, dout


def selection(m, x, bias):
    """The module's expert choice, recomputed in float64 from the scores its own eager router gives.
    Returns (chosen [T, E] bool, clear [T] bool). A token is clear when none of its decisions is closer
    than a last-bits difference between eager and inductor could move: the K-th against the (K+1)-th
    selection score, and with groups also the last kept group against the first dropped one."""
    r = m.router
    with torch.no_grad():
        idx, _, probs = r(x, bias, m.bf16_logits)
    s = probs.double()
    if m.bf16_logits:  # the scores are rounded to bf16: 3 ulps of each
        u = 3 * torch.exp2(torch.floor(torch.log2(s.clamp_min(1e-30))) - 7)
    else:              # fp32 logits of a bf16 GEMM: cuBLAS against inductor's order, ~1e-6
        u = torch.full_like(s, 5e-5)
    sel = s if bias is None else s + bias.double()
    T = sel.shape[0]
    clear = torch.ones(T, dtype=torch.bool, device=x.device)

    def apart(v, uv, k):  # v [T, M] sorted descending, uncertainties uv: the k-th is above the (k+1)-th
        if k >= v.shape[1]:
            return torch.ones_like(clear)
        return (v[:, k - 1] - v[:, k]) > uv[:, k - 1] + uv[:, k]

    if r.num_expert_groups is not None:
        G, L = r.num_expert_groups, r.num_limited_groups
        g = sel.view(T, G, -1).topk(2, dim=-1).values.sum(-1)
        ug = 2 * u.view(T, G, -1).amax(-1)
        gv, gi = g.sort(dim=-1, descending=True)
        clear &= apart(gv, ug.gather(1, gi), L)
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gi[:, :L], True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    v, order = sel.sort(dim=-1, descending=True)
    clear &= apart(v, u.gather(1, order), r.top_k)
    chosen = torch.zeros_like(sel, dtype=torch.bool).scatter_(1, order[:, :r.top_k], True)
    from_router = torch.zeros_like(chosen).scatter_(1, idx.long(), True)
    assert torch.equal(chosen[clear], from_router[clear]), "the float64 replica disagrees with the router"
    return chosen, clear


def clear_inputs(m, x, gen):
    """x with every token whose torch-side routing is a near-tie redrawn as a fresh random row, so that
    eager and compiled choose the same experts. x is returned unchanged where the fused kernel routes,
    because the same op decides in both."""
    if not torch_routed(m):
        return x
    for _ in range(200):
        _, clear = selection(m, x, m.expert_bias)
        bad = (~clear).nonzero()[:, 0]
        if bad.numel() == 0:
            return x
        x = x.clone()
        x[bad] = torch.randn(bad.numel(), x.shape[1], generator=gen, device="cuda").to(x.dtype)
    pytest.fail("could not draw inputs without near-ties in the torch router's choice")


def run_step(f, m, x, dout):
    """One training step through f, the eager module or the compiled twin (m is its module). Returns
    out, the gradients of x and of every parameter, and the aux loss (None if the module has none).
    The aux loss is added to the loss, as a trainer adds it."""
    m.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    out = f(xg)
    aux = m.aux_loss
    if aux is None:
        out.backward(dout)
    else:
        torch.autograd.backward([out, aux], [dout, torch.ones_like(aux)])
    grads = {"x": xg.grad, **{name: p.grad for name, p in m.named_parameters()}}
    return out.detach(), grads, None if aux is None else aux.detach()


def assert_close(got, want, tol, what):
    """Bitwise equality for tol 0, else relative L2 <= tol. A zero `want` must be matched exactly."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {tuple(got.shape)} {got.dtype} against eager's {tuple(want.shape)} {want.dtype}"
    if tol == 0:
        assert torch.equal(got, want), \
            f"{what}: compiled differs from eager (bitwise expected), rel L2 {rel_l2(got, want):.3e}"
    elif want.float().norm().item() == 0:
        assert got.float().norm().item() == 0, f"{what}: eager is zero, compiled is not"
    else:
        err = rel_l2(got, want)
        assert err <= tol, f"{what}: rel L2 {err:.3e} > {tol}"


def graphs_compiled():
    """The number of graphs dynamo has compiled so far in this process. A compiled call that adds none
    reused a cached graph; none at all after reset means the call was not compiled."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("path", list(PATHS))
def test_compiled_training_steps_match_eager(path):
    """Two training steps, compiled (fullgraph) against eager: out, the aux loss, and the gradients of x
    and every parameter. With an expert bias, also the counts after each step and the bias after each
    update_expert_bias(). The bias is changed by hand before the second step, so the compiled graph
    must read the buffer and not a copy of its first value."""
    import torch._dynamo
    torch._dynamo.reset()
    gen = fresh_gen()
    eager, twin, x, dout = build_pair(path, gen)
    compiled = torch.compile(twin, fullgraph=True)
    T = x.shape[0]
    for step in range(2):
        msg = f"seed={gen.initial_seed()} path={path} step={step}"
        if step == 1:
            x = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
            dout = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
            if eager.expert_bias is not None:
                shift = torch.randn(E, generator=gen, device="cuda") * BIAS_STD
                new = eager.expert_bias + shift.to(eager.expert_bias.dtype)
                eager.expert_bias.copy_(new)
                twin.expert_bias.copy_(new)
        x = clear_inputs(eager, x, gen)
        if eager.expert_bias is not None:  # the bias must change some choice here, else it goes untested
            with_bias, _ = selection(eager, x, eager.expert_bias)
            without, _ = selection(eager, x, None)
            assert not torch.equal(with_bias, without), f"{msg}: the expert bias changes no token's choice"
        before = graphs_compiled()
        with numerics(eager):
            oe, ge, ae = run_step(eager, eager, x, dout)
            oc, gc, ac = run_step(compiled, twin, x, dout)
        if step == 0:
            assert graphs_compiled() > before, f"{msg}: the compiled call compiled no graph"
        assert_close(oc, oe, tolerance(eager, "out"), f"{msg} out")
        assert set(gc) == set(ge)
        for name in ge:
            assert ge[name] is not None, f"{msg}: eager gave {name} no gradient"
            assert gc[name] is not None, f"{msg}: compiled gave {name} no gradient"
            assert_close(gc[name], ge[name], tolerance(eager, name), f"{msg} d{name}")
        assert (ac is None) == (ae is None) == (eager.aux_loss_coef == 0), f"{msg}: aux loss {ae} against {ac}"
        if ae is not None:
            assert_close(ac, ae, tolerance(eager, "aux_loss"), f"{msg} aux_loss")
        if eager.expert_bias is not None:
            tpe = eager.tokens_per_expert
            chosen, _ = selection(eager, x, eager.expert_bias)
            assert torch.equal(tpe, chosen.sum(0).to(tpe.dtype)), f"{msg}: eager counted {tpe.tolist()}"
            assert torch.equal(twin.tokens_per_expert, tpe), \
                f"{msg}: compiled counted {twin.tokens_per_expert.tolist()}, eager {tpe.tolist()}"
            eager.update_expert_bias()
            twin.update_expert_bias()
            assert torch.equal(twin.expert_bias, eager.expert_bias), f"{msg}: expert_bias after the update"
            assert twin.tokens_per_expert.abs().sum().item() == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_compiled_module_counts_once_under_eager_checkpointing(reentrant):
    """The compiled module inside an eager activation checkpoint (torch.utils.checkpoint around the
    compiled call). The backward recomputes by running the compiled graph again; its count op
    (smoe::count_tokens_once) decides when it runs, not when it is traced, so it skips there and the
    tokens are counted once, as in eager. Out and dx match eager's within the training-step bounds."""
    from torch.utils.checkpoint import checkpoint
    import torch._dynamo
    torch._dynamo.reset()
    gen = fresh_gen()
    eager, twin, x, dout = build_pair("expert_bias", gen)
    compiled = torch.compile(twin, fullgraph=True)
    x = clear_inputs(eager, x, gen)
    msg = f"seed={gen.initial_seed()} reentrant={reentrant}"
    res = []
    for f, m in ((eager, eager), (compiled, twin)):
        xg = x.clone().requires_grad_(True)
        out = checkpoint(f, xg, use_reentrant=reentrant)
        out.backward(dout)
        assert m.tokens_per_expert.sum().item() == x.shape[0] * K, f"{msg}: counted {m.tokens_per_expert.tolist()}"
        res.append((out.detach(), xg.grad))
    chosen, _ = selection(eager, x, eager.expert_bias)
    assert torch.equal(eager.tokens_per_expert, chosen.sum(0).float()), msg
    assert torch.equal(twin.tokens_per_expert, eager.tokens_per_expert), msg
    (oe, ge), (oc, gc) = res
    assert_close(oc, oe, tolerance(eager, "out"), f"{msg} out")
    assert_close(gc, ge, tolerance(eager, "x"), f"{msg} dx")


@pytest.mark.parametrize("path", EVAL_RULE_PATHS)
def test_compiled_eval_counts_nothing_and_routes_by_plain_topk(path):
    """MoE's eval rules hold in the compiled module, and train() restores the training rules (dynamo
    recompiles on the mode).
    In eval: no token is counted (counts preset to nonzero values stay as they are), aux_loss is None,
    and a token-rounding module routes by plain top-K, bitwise the output of the same module built
    without token rounding.
    Back in training: the module counts once, has an aux loss and rounds. Its output then differs from
    plain top-K, which shows that the eval check can fail."""
    import torch._dynamo
    torch._dynamo.reset()
    gen = fresh_gen()
    eager, twin, x, _ = build_pair(path, gen)
    compiled = torch.compile(twin, fullgraph=True)
    msg = f"seed={gen.initial_seed()} path={path}"
    if eager.expert_bias is not None:
        preset = torch.randint(1, 50, (E,), generator=gen, device="cuda").to(eager.tokens_per_expert.dtype)
        eager.tokens_per_expert.copy_(preset)
        twin.tokens_per_expert.copy_(preset)
    x = clear_inputs(eager, x, gen)
    plain = None
    if eager.token_rounding is not None:
        kw = {k: v for k, v in PATHS[path].items() if k not in ("token_rounding", "rounding_seed", "params")}
        plain = smoe_torch.MoE(D, N, E, K, **kw).cuda().to(eager.router.gate.weight.dtype)
        plain.load_state_dict(eager.state_dict())
        plain.eval()
    for mode in ("eval", "train"):
        eager.train(mode == "train")
        twin.train(mode == "train")
        before = graphs_compiled()
        with torch.no_grad(), numerics(eager):
            oe, oc = eager(x), compiled(x)
        assert graphs_compiled() > before, f"{msg} {mode}: the compiled call compiled no graph for this mode"
        assert_close(oc, oe, tolerance(eager, "out"), f"{msg} {mode} out")
        if mode == "eval":
            assert eager.aux_loss is None and twin.aux_loss is None, f"{msg}: an aux loss in eval"
            if plain is not None:
                with torch.no_grad():
                    assert torch.equal(oc, plain(x)), f"{msg}: compiled eval is not plain top-K"
        else:
            has_aux = eager.aux_loss_coef > 0
            assert (eager.aux_loss is not None) == has_aux and (twin.aux_loss is not None) == has_aux, msg
            if has_aux:
                assert_close(twin.aux_loss, eager.aux_loss, tolerance(eager, "aux_loss"), f"{msg} train aux_loss")
            if plain is not None:
                with torch.no_grad():
                    assert not torch.equal(oc, plain(x)), f"{msg}: token rounding changed no row (untested)"
        if eager.expert_bias is not None:
            want = preset
            if mode == "train":
                counted = selection(eager, x, eager.expert_bias)[0].sum(0)
                want = (preset.float() + counted).to(preset.dtype)
            got_e, got_c = eager.tokens_per_expert, twin.tokens_per_expert
            assert torch.equal(got_e, want), f"{msg} {mode}: eager counted {got_e.tolist()}"
            assert torch.equal(got_c, want), f"{msg} {mode}: compiled counted {got_c.tolist()}"


@pytest.mark.parametrize("path", [p for p, kw in PATHS.items() if kw.get("bf16_logits")])
def test_bf16_logits_under_default_inductor_numerics(path):
    """The bf16-logit router compiled with inductor's default numerics (emulate_precision_casts off),
    forward only. Inductor then keeps the bf16 softmax in fp32 instead of rounding it to bf16. Where no
    two scores are within a few bf16 ulps (the inputs are drawn that way), the compiled module still
    chooses eager's experts and counts eager's tokens, and its output is within TOL. Its gradients are
    test_compiled_training_steps_match_eager's job, run there with eager's roundings kept."""
    import torch._dynamo
    torch._dynamo.reset()
    gen = fresh_gen()
    eager, twin, x, _ = build_pair(path, gen)
    compiled = torch.compile(twin, fullgraph=True)
    x = clear_inputs(eager, x, gen)
    oe, oc = eager(x), compiled(x)
    assert_close(oc.detach(), oe.detach(), TOL, f"seed={gen.initial_seed()} path={path} out")
    if eager.expert_bias is not None:
        assert torch.equal(twin.tokens_per_expert, eager.tokens_per_expert), \
            f"compiled counted {twin.tokens_per_expert.tolist()}, eager {eager.tokens_per_expert.tolist()}"


def test_paths_cover_every_router_option():
    """The table above uses every routing option MoE takes (except ep_group and ep_mesh, which need 2 GPUs), so a
    new keyword argument of MoE fails here until it has a path."""
    import inspect
    routing = set(inspect.signature(smoe_torch.MoE).parameters) - {
        "self", "dim", "hidden_dim", "num_experts", "top_k",  # shapes
        "ep_group",        # 2 GPUs: tests/python/test_ep.py
        "ep_mesh",         # with ep_group only: tests/python/test_moe_ep_mesh.py
        "dp_group",        # the all-reduce of the counts: test_torch_moe.py (gloo)
        "pack_gate_up",    # parameter layout, not routing: test_torch_moe.py's compile test packs
    }
    used = {k for kw in PATHS.values() for k in kw} - {"params"}
    assert routing == used, f"options without a path: {sorted(routing - used)}; unknown: {sorted(used - routing)}"
