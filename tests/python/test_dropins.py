"""The drop-ins (smoe_torch.dropins: torchtitan, Megatron-Core, transformers) against the frameworks.

Each drop-in's forward and every gradient is compared with the framework's own module at fresh random
inputs (relative L2 <= 1e-2, bf16): torchtitan 0.3.0's GroupedExperts / RoutedExperts, Megatron-Core
0.16.1's GroupedMLP (its grouped_gemm kernel replaced by a per-expert matmul loop, the rest real) and
TEGroupedMLP (when Transformer Engine is importable), transformers 5.24.0's experts classes (eager)
and a whole tiny Qwen3-MoE model. Where a framework is not importable the pure-torch twins of
framework_twins.py (transcriptions of the pinned versions' code) stand in for it, and the tests say
so in their ids (`twin`). Also: state-dict round trips, the torchtitan @override hook and the in-place
swap (same Parameter objects), Megatron's weight copies and their cache, transformers' registry, EP
sentinels, the gpt-oss refusal / fallback, determinism.

Three backends run every comparison:
  ref:      CPU, smoe_torch.expert_major monkeypatched with expert_major_ref (the drop-ins' wiring,
            anywhere; without the built extension, smoe_torch is a stub package over python/smoe_torch);
  ref-cuda: the same on CUDA (the frameworks' CUDA code paths; skips without CUDA);
  gpu:      CUDA, the real smoe_torch.expert_major (skips without CUDA or an extension with the ops).
The real frameworks install offline from the wheelhouse: scripts/fetch_wheels.sh (says how).
Run: python3 -m pytest -q tests/python/test_dropins.py
"""
import copy
import importlib
import os
import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import framework_twins as tw  # noqa: E402

TOL = 1e-2


# ------------------------------------------------------------------------------------------------
# smoe_torch: the real package, or a stub over the sources (no extension)
# ------------------------------------------------------------------------------------------------
def _import_smoe():
    src = str(ROOT / "python" / "smoe_torch")
    try:
        import smoe_torch
        have_ext = True
    except Exception:  # noqa: BLE001  (no built extension / no CUDA runtime)
        for k in [k for k in sys.modules if k == "smoe_torch" or k.startswith("smoe_torch.")]:
            del sys.modules[k]
        smoe_torch = types.ModuleType("smoe_torch")
        smoe_torch.__path__ = [src]
        sys.modules["smoe_torch"] = smoe_torch
        have_ext = False
    if have_ext and not (pathlib.Path(smoe_torch.__file__).parent / "dropins").is_dir() \
            and src not in list(smoe_torch.__path__):
        smoe_torch.__path__.append(src)  # an installed package without the dropins subpackage
    return smoe_torch, have_ext


smoe_torch, HAVE_EXT = _import_smoe()
_em_fn = smoe_torch.__dict__.get("expert_major") if HAVE_EXT else None
try:
    _em_mod = importlib.import_module("smoe_torch.expert_major")
    REF = _em_mod.expert_major_ref
    REF_NAME = "smoe_torch.expert_major_ref"
except Exception:  # noqa: BLE001
    _em_mod, REF, REF_NAME = None, tw.expert_major_twin, "framework_twins.expert_major_twin"
if not HAVE_EXT:
    smoe_torch.expert_major = REF  # the stub's attribute (the ref backend patches it per test anyway)

from smoe_torch.dropins import megatron as dmeg  # noqa: E402
from smoe_torch.dropins import torchtitan as dtt  # noqa: E402

if not torch.cuda.is_available():
    _GPU_SKIP = "no CUDA GPU"
elif not HAVE_EXT:
    _GPU_SKIP = "smoe_torch (the built extension) is not importable"
elif _em_mod is None or not callable(_em_fn) or not _em_mod._ops_available():
    _GPU_SKIP = "smoe_torch has no expert_major ops"
else:
    _GPU_SKIP = None


def _have(mod):
    try:
        importlib.import_module(mod)
        return True
    except Exception:  # noqa: BLE001
        return False


HAVE_TT = dtt.HAVE_TORCHTITAN
HAVE_MEG = _have("megatron.core.transformer.moe.experts")
HAVE_HF = _have("transformers.integrations.moe")
# The EP sentinel (top_k_index == num_experts: not a local expert) is skipped by the eager experts forward
# of transformers 5.24.0, the version the drop-in is written and pinned against (scripts/fetch_wheels.sh).
# Older ones (5.17.0, preinstalled on the GPU machine) index one_hot with it: a RuntimeError on the CPU, a
# device-side assert on CUDA that poisons the process's CUDA context and fails every later GPU test.
HF_PINNED = "5.24.0"
HF_VERSION = importlib.import_module("transformers").__version__ if HAVE_HF else None


def _hf_at_least(v):
    from packaging.version import Version
    return HF_VERSION is not None and Version(HF_VERSION) >= Version(v)
HAVE_TE = torch.cuda.is_available() and _have("transformer_engine.pytorch")
if HAVE_HF:
    from smoe_torch.dropins import transformers as dhf


@pytest.fixture(params=["ref", "ref-cuda", "gpu"])
def device(request, monkeypatch):
    """The backend: 'ref' = CPU with expert_major := expert_major_ref; 'ref-cuda' = the same on CUDA
    (the frameworks' own CUDA paths, e.g. torch._grouped_mm, without the extension); 'gpu' = CUDA,
    the real op."""
    if request.param in ("ref", "ref-cuda"):
        if request.param == "ref-cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")
        monkeypatch.setattr(smoe_torch, "expert_major", REF, raising=False)
        return torch.device("cpu" if request.param == "ref" else "cuda")
    if _GPU_SKIP:
        pytest.skip(_GPU_SKIP)
    monkeypatch.setattr(smoe_torch, "expert_major", _em_fn, raising=False)
    return torch.device("cuda")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def gen():
    g = torch.Generator()
    g.seed()
    return g


def randn(*shape, g, scale=1.0, device="cpu", dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(actual, ref, what, tol=TOL):
    assert actual is not None, f"{what}: no value / gradient"
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(actual.float()).all(), f"{what}: non-finite"
    if ref.double().norm().item() == 0.0:
        assert actual.double().abs().max().item() == 0.0, f"{what}: reference is zero, this is not"
        return
    err = rel_l2(actual, ref)
    assert err <= tol, f"{what}: rel L2 {err:.3g} > {tol}"


def random_counts(E, g, total_hint=200, zeros=2):
    c = torch.randint(0, 2 * total_hint // E + 1, (E,), generator=g)
    c[torch.randperm(E, generator=g)[:zeros]] = 0
    if int(c.sum()) == 0:
        c[0] = 5
    return c


def run(fn, inputs, params, dout):
    """out = fn(); out.backward(dout); (out, grads of inputs and params) detached."""
    for t in inputs + params:
        t.grad = None
    out = fn()
    out.backward(dout)
    return [out.detach()] + [t.grad.detach() if t.grad is not None else None for t in inputs + params]


def compare(names, got, want, tol=TOL):
    for nm, a, b in zip(names, got, want):
        assert_close(a, b, nm, tol)


D, N, E = 128, 64, 8  # multiples of 64 (the GPU layer's rule)


# ================================================================================================
# the ref this file uses vs this file's own twin (the expert-major contract, all layouts)
# ================================================================================================
@pytest.mark.parametrize("gate_up", ["interleaved", "separate", "concatenated"])
@pytest.mark.parametrize("segmented", [False, True])
def test_ref_matches_the_expert_major_contract_twin(gate_up, segmented):
    if REF is tw.expert_major_twin:
        pytest.skip("smoe_torch.expert_major_ref not importable: the twin is the ref")
    g = gen()
    counts = random_counts(E, g)
    if segmented:
        seg = torch.zeros(E + 1, dtype=torch.int64)
        seg[1:] = torch.cumsum(counts + torch.randint(0, 5, (E,), generator=g), 0)
        R = int(seg[-1]) + 3
    else:
        seg, R = None, int(counts.sum()) + 4  # trailing padding
    x = randn(R, D, g=g, dtype=torch.float32)
    w1 = randn(E, 2 * N if gate_up != "separate" else N, D, g=g, scale=D ** -0.5, dtype=torch.float32)
    w3 = randn(E, N, D, g=g, scale=D ** -0.5, dtype=torch.float32) if gate_up == "separate" else None
    w2 = randn(E, D, N, g=g, scale=N ** -0.5, dtype=torch.float32)
    p = torch.rand(R, generator=g)
    a = REF(x, counts, w1, w2, w3, probs=p, segment_offset=seg, gate_up=gate_up)
    b = tw.expert_major_twin(x, counts, w1, w2, w3, probs=p, segment_offset=seg, gate_up=gate_up)
    assert_close(a, b, "out", 1e-5)  # both fp32 end to end


# ================================================================================================
# torchtitan
# ================================================================================================
TT_SRC = "torchtitan" if HAVE_TT else "twin"


def tt_reference_module(device):
    if HAVE_TT:
        from torchtitan.models.common.moe import GroupedExperts
        m = GroupedExperts.Config(dim=D, hidden_dim=N, num_experts=E).build()
    else:
        m = tw.TorchtitanGroupedExpertsTwin(D, N, E)
    g = gen()
    with torch.no_grad():
        m.w1_EFD.copy_(torch.randn(E, N, D, generator=g) * D ** -0.5)
        m.w3_EFD.copy_(torch.randn(E, N, D, generator=g) * D ** -0.5)
        m.w2_EDF.copy_(torch.randn(E, D, N, generator=g) * N ** -0.5)
    return m.to(device=device, dtype=torch.bfloat16)


def tt_smoe_module(ref):
    m = dtt.SmoeGroupedExperts(dtt.SmoeGroupedExperts.Config(dim=D, hidden_dim=N, num_experts=E))
    m = m.to(device=ref.w1_EFD.device, dtype=torch.bfloat16)
    m.load_state_dict(ref.state_dict())
    return m


def _tt_grads(m, x, counts, dout):
    return run(lambda: m(x, counts), [x], [m.w1_EFD, m.w2_EDF, m.w3_EFD], dout)


@pytest.mark.parametrize("src", [TT_SRC])
@pytest.mark.parametrize("padding", ["none", "capacity_tail"])
def test_torchtitan_forward_and_all_gradients(device, src, padding):
    ref = tt_reference_module(device)
    sm = tt_smoe_module(ref)
    g = gen()
    counts = random_counts(E, g)
    R = int(counts.sum()) + (16 if padding == "capacity_tail" else 0)  # HybridEP capacity: rows past sum
    x = randn(R, D, g=g, device=device).requires_grad_()
    dout = randn(R, D, g=g, device=device)
    dc = counts.to(device)
    valid = int(counts.sum())
    dout[valid:] = 0  # torchtitan's rows past sum(counts) are unwritten: compare the valid rows only
    want = _tt_grads(ref, x, dc, dout)
    got = _tt_grads(sm, x, dc, dout)
    # torchtitan's rows past sum(counts) (out and dx) are unwritten by torch._grouped_mm: compare the
    # valid rows; the expert-major layer must give exact zeros there
    pad_out, pad_dx = got[0][valid:], got[1][valid:]
    for i in (0, 1):
        want[i], got[i] = want[i][:valid], got[i][:valid]
    compare(["out", "dx", "dw1", "dw2", "dw3"], got, want)
    if pad_out.numel():
        assert pad_out.abs().max().item() == 0 and pad_dx.abs().max().item() == 0, "padding rows must be zero"


@pytest.mark.parametrize("src", [TT_SRC])
def test_torchtitan_state_dict_round_trip(src):
    ref = tt_reference_module("cpu")
    sm = tt_smoe_module(ref)
    sd_ref, sd_sm = ref.state_dict(), sm.state_dict()
    assert list(sd_ref) == list(sd_sm) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    for k in sd_ref:
        assert sd_ref[k].shape == sd_sm[k].shape and torch.equal(sd_ref[k], sd_sm[k]), k
    back = copy.deepcopy(ref)
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    back.load_state_dict(sd_sm)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd_ref[k]), k


needs_tt = pytest.mark.skipif(not HAVE_TT, reason="torchtitan not importable (pip install from the wheelhouse)")


@needs_tt
def test_torchtitan_override_hook_builds_smoe_experts(device):
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    K = 2

    def cfg():
        return RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=D, hidden_dim=N, num_experts=E),
                                    token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    stock_cfg, smoe_cfg = cfg(), cfg()
    lines = apply_overrides(OverrideConfig(imports=["smoe_torch.dropins.torchtitan.smoe_grouped_experts"]), smoe_cfg)
    assert len(lines) == 1 and "SmoeGroupedExperts" in lines[0], lines
    assert type(smoe_cfg.inner_experts) is dtt.SmoeGroupedExperts.Config
    stock, sm = stock_cfg.build(), smoe_cfg.build()
    assert type(sm.inner_experts) is dtt.SmoeGroupedExperts
    g = gen()
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    stock = stock.to(device=device, dtype=torch.bfloat16)
    sm = sm.to(device=device, dtype=torch.bfloat16)
    sm.load_state_dict(stock.state_dict())
    assert list(sm.state_dict()) == list(stock.state_dict())
    # the whole routed-experts region: torchtitan's dispatcher + experts + combine
    B, L = 2, 48
    x = randn(B, L, D, g=g, device=device).requires_grad_()
    scores = torch.rand(B, L, K, generator=g).to(device).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * L)]).view(B, L, K).to(device)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    dout = randn(B, L, D, g=g, device=device)

    def grads(m):
        return run(lambda: m(x, scores, ids, counts), [x, scores], list(m.inner_experts.parameters()), dout)
    compare(["out", "dx", "dscores", "dw1", "dw2", "dw3"], grads(sm), grads(stock))


@needs_tt
def test_torchtitan_swap_keeps_the_parameter_objects(device):
    from torchtitan.models.common.moe import GroupedExperts
    ref = tt_reference_module(device)
    model = torch.nn.Sequential(copy.deepcopy(ref))
    before = {k: id(p) for k, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert dtt.swap_grouped_experts(model) == 1
    assert dtt.swap_grouped_experts(model) == 0  # idempotent
    m = model[0]
    assert isinstance(m, GroupedExperts) and isinstance(m, dtt._SmoeForward)
    assert {k: id(p) for k, p in model.named_parameters()} == before
    assert [id(p) for p in opt.param_groups[0]["params"]] == list(before.values())
    g = gen()
    counts = random_counts(E, g)
    x = randn(int(counts.sum()), D, g=g, device=device).requires_grad_()
    dout = randn(x.shape[0], D, g=g, device=device)
    compare(["out", "dx", "dw1", "dw2", "dw3"], _tt_grads(m, x, counts.to(device), dout),
            _tt_grads(ref, x, counts.to(device), dout))


def test_torchtitan_functional_takes_counts_from_the_host(device):
    ref = tt_reference_module(device)
    g = gen()
    counts = random_counts(E, g)
    x = randn(int(counts.sum()), D, g=g, device=device)
    a = dtt.grouped_experts_forward(ref.w1_EFD, ref.w2_EDF, ref.w3_EFD, x, counts)  # CPU int64 counts
    b = ref(x, counts.to(device))
    assert a.dtype == x.dtype
    assert_close(a, b, "out")


# ================================================================================================
# Megatron-Core
# ================================================================================================
MEG_SRC = "megatron" if HAVE_MEG else "twin"
MEG_CLASSES = dmeg.megatron_expert_classes() + (tw.MegatronGroupedMLPTwin, tw.MegatronTEGroupedMLPTwin)


@pytest.fixture(scope="module")
def megatron_env():
    """A 1-rank gloo group, grouped_gemm replaced by a per-expert matmul loop, no jit fuser."""
    if not HAVE_MEG:
        yield None
        return
    import torch.distributed as dist
    from megatron.core.transformer.moe import experts as mexp
    from megatron.core.transformer.moe import grouped_gemm_util as gg
    if not dist.is_initialized():
        store = dist.FileStore(str(ROOT / "out" / f".dropins_store_{os.getpid()}") if (ROOT / "out").is_dir()
                               else f"/tmp/.dropins_store_{os.getpid()}", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    saved = (gg.grouped_gemm, gg.ops, mexp.jit_fuser)
    shim = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=tw.grouped_gemm_gmm))
    gg.grouped_gemm, gg.ops, mexp.jit_fuser = shim, shim.ops, (lambda f: f)
    yield mexp
    gg.grouped_gemm, gg.ops, mexp.jit_fuser = saved


def megatron_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    args = dict(num_layers=1, hidden_size=D, num_attention_heads=1, moe_ffn_hidden_size=N, num_moe_experts=E,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                params_dtype=torch.bfloat16, use_cpu_initialization=True, moe_grouped_gemm=True)
    args.update(kw)
    return TransformerConfig(**args)


def _probs_kw(on_input):
    return dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True) if on_input else {}


def megatron_module(kind, device, env, apply_probs_on_input=False):
    """GroupedMLP ('legacy') or TEGroupedMLP ('te'): the real one when importable, else the twin."""
    cfg_ns = types.SimpleNamespace(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                                   moe_apply_probs_on_input=apply_probs_on_input)
    if kind == "legacy":
        if env is not None:
            import torch.distributed as dist
            from megatron.core.process_groups_config import ProcessGroupCollection
            w = dist.group.WORLD
            m = env.GroupedMLP(E, megatron_config(**_probs_kw(apply_probs_on_input)),
                               ProcessGroupCollection(ep=w, expt_tp=w, expt_dp=w))
        else:
            m = tw.MegatronGroupedMLPTwin(E, D, N, cfg_ns)
    else:
        if HAVE_TE and env is not None and device.type == "cuda":
            from megatron.core.extensions.transformer_engine import (TEColumnParallelGroupedLinear,
                                                                     TERowParallelGroupedLinear)
            from megatron.core.transformer.mlp import MLPSubmodules
            import torch.distributed as dist
            from megatron.core.process_groups_config import ProcessGroupCollection
            w = dist.group.WORLD
            m = env.TEGroupedMLP(E, megatron_config(**_probs_kw(apply_probs_on_input), use_cpu_initialization=False),
                                 MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                                               linear_fc2=TERowParallelGroupedLinear),
                                 ProcessGroupCollection(ep=w, expt_tp=w, expt_dp=w, tp=w))  # untested: no TE here
        else:
            m = tw.MegatronTEGroupedMLPTwin(E, D, N, cfg_ns)
    g = gen()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (D ** -0.5 if ("1" in name.split(".")[0]) else N ** -0.5))
    return m.to(device=device, dtype=torch.bfloat16)


def meg_inputs(device, g, R_extra=0):
    counts = random_counts(E, g)
    R = int(counts.sum())
    x = randn(R, D, g=g, device=device).requires_grad_()
    probs = torch.rand(R, generator=g).to(device).requires_grad_()
    dout = randn(R, D, g=g, device=device)
    return counts, x, probs, dout


def meg_run(fn, x, probs, params, dout):
    return run(lambda: fn()[0], [x, probs], params, dout)


def meg_kind_src(kind):
    if kind == "legacy":
        return MEG_SRC
    return "megatron-te" if (HAVE_TE and HAVE_MEG) else "twin"


@pytest.mark.parametrize("kind,src", [("legacy", meg_kind_src("legacy")), ("te", meg_kind_src("te"))])
@pytest.mark.parametrize("counts_on", ["host", "device"])
def test_megatron_forward_and_all_gradients(device, megatron_env, kind, src, counts_on):
    m = megatron_module(kind, device, megatron_env)
    params = list(m.parameters())
    g = gen()
    counts, x, probs, dout = meg_inputs(device, g)
    tpe = counts if counts_on == "host" else counts.to(device)
    want = meg_run(lambda: m(x, counts, probs), x, probs, params, dout)
    assert dmeg.patch_megatron_experts(torch.nn.ModuleList([m]), classes=MEG_CLASSES) == 1
    try:
        got = meg_run(lambda: m(x, tpe, probs), x, probs, params, dout)
    finally:
        del m.forward  # back to Megatron's own forward
    names = ["out", "dx", "dprobs"] + [f"d{k}" for k, _ in m.named_parameters()]
    compare(names, got, want)


@pytest.mark.parametrize("kind", ["legacy", "te"])
def test_megatron_functional_apply_probs_on_input_and_3d_weights(device, megatron_env, kind):
    m = megatron_module(kind, device, megatron_env, apply_probs_on_input=True)
    fc1, fc2, n_e = dmeg.module_weights(m)
    g = gen()
    counts, x, probs, dout = meg_inputs(device, g)
    if kind == "legacy":
        def want_fn():
            return tw.megatron_grouped_mlp_forward(m.weight1, m.weight2, E, D, x, counts, probs, True)
    else:
        def want_fn():
            return tw.megatron_te_grouped_mlp_forward(fc1, fc2, x, counts, probs, True)
    params = list(m.parameters())
    want = meg_run(want_fn, x, probs, params, dout)
    got = meg_run(lambda: dmeg.megatron_grouped_mlp(x, counts, probs, fc1, fc2, num_local_experts=n_e,
                                                    apply_probs_on_input=True), x, probs, params, dout)
    compare(["out", "dx", "dprobs"] + ["dw"] * len(params), got, want)
    # already expert-major 3-D tensors go in as they are (no copy)
    w1, w2 = dmeg.expert_major_weights(fc1, fc2, n_e)
    w1, w2 = w1.detach().clone(), w2.detach().clone()
    a, b = dmeg.expert_major_weights(w1, w2)
    assert a is w1 and b is w2


def test_megatron_weight_copy_cache_follows_the_version(device, megatron_env):
    m = megatron_module("legacy", device, megatron_env)
    w1a, _ = dmeg.expert_major_weights(m.weight1, m.weight2, E, cache=True)
    w1b, _ = dmeg.expert_major_weights(m.weight1, m.weight2, E, cache=True)
    assert w1a.data_ptr() == w1b.data_ptr(), "a second forward at the same weight version must reuse the copy"
    want = m.weight1.detach().view(E, D, 2 * N).transpose(1, 2).clone()
    assert torch.equal(w1a, want)
    with torch.no_grad():
        m.weight1.mul_(2)  # an optimizer step through the Parameter bumps _version
    w1c, _ = dmeg.expert_major_weights(m.weight1, m.weight2, E, cache=True)
    assert w1c.data_ptr() != w1a.data_ptr() and torch.equal(w1c, 2 * want)
    dmeg.clear_weight_cache(m)
    assert not hasattr(m.weight1, "_smoe_em_cache")
    # gradient accumulation over two micro-batches through the cached copy == the sum of the two
    g = gen()
    params = [m.weight1, m.weight2]
    for p in params:
        p.grad = None
    outs = []
    for _ in range(2):
        counts, x, probs, dout = meg_inputs(device, g)
        dmeg.megatron_grouped_mlp(x, counts, probs, m.weight1, m.weight2, num_local_experts=E, cache=True)[0] \
            .backward(dout)
        outs.append((counts, x.detach(), probs.detach(), dout))
    acc = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    for counts, x, probs, dout in outs:
        tw.megatron_grouped_mlp_forward(m.weight1, m.weight2, E, D, x, counts, probs)[0].backward(dout)
    compare(["dweight1 (accumulated)", "dweight2 (accumulated)"], acc, [p.grad for p in params])
    dmeg.clear_weight_cache(m)


@pytest.mark.parametrize("kind", ["legacy", "te"])
def test_megatron_state_dict_round_trip_and_no_rows(device, megatron_env, kind):
    m = megatron_module(kind, device, megatron_env)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    n = dmeg.patch_megatron_experts(torch.nn.ModuleList([m]), classes=MEG_CLASSES)
    assert n == 1
    sd2 = m.state_dict()
    assert list(sd2) == list(sd)
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    fresh = megatron_module(kind, device, megatron_env)
    fresh.load_state_dict(sd2)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # no rows routed here: empty output, every weight still gets a (zero) gradient, as Megatron
    x = torch.zeros(0, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.zeros(0, device=device, requires_grad=True)
    out, bias = m(x, torch.zeros(E, dtype=torch.int64), probs)
    assert bias is None and out.shape == (0, D)
    out.sum().backward()
    for k, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().max().item() == 0, k
    del m.forward


@pytest.mark.skipif(not HAVE_MEG, reason="megatron-core not importable")
def test_megatron_refuses_what_it_does_not_compute():
    for kw in (dict(gated_linear_unit=False), dict(activation_func=F.gelu), dict(add_bias_linear=True),
               dict(activation_func_clamp_value=7.0), dict(glu_linear_offset=1.0)):
        cfg = types.SimpleNamespace(**{**dict(gated_linear_unit=True, activation_func=F.silu), **kw})
        with pytest.raises(ValueError, match="unsupported expert config"):
            dmeg._check_config(cfg)
    dmeg._check_config(megatron_config())


# ================================================================================================
# transformers
# ================================================================================================
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="transformers not importable (pip install from the wheelhouse)")


def hf_experts(family, device, K=2):
    """A real experts module of `family` (transformers 5.24.0) with random weights."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as C
        cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=N, num_experts=E, num_experts_per_tok=K)
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as C
        cfg = MixtralConfig(hidden_size=D, intermediate_size=N, num_local_experts=E, num_experts_per_tok=K)
    elif family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as C
        cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=N, n_routed_experts=E, num_experts_per_tok=K)
    elif family == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts as C
        cfg = OlmoeConfig(hidden_size=D, intermediate_size=N, num_experts=E, num_experts_per_tok=K)
    else:
        raise ValueError(family)
    m = C(cfg)
    g = gen()
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * D ** -0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * N ** -0.5)
    return m.to(device=device, dtype=torch.bfloat16), cfg


def hf_routing(T, K, device, g, sentinels=0):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).softmax(-1).to(device=device, dtype=torch.bfloat16)
    if sentinels:
        rows = torch.randperm(T, generator=g)[:sentinels].to(device)
        ids[rows, 0] = E  # EP sentinel (not a local expert), weight 0
        w[rows, 0] = 0
    return ids, w.requires_grad_()


def hf_run(m, cfg, impl, x, ids, w, dout):
    cfg._experts_implementation = impl
    return run(lambda: m(x, ids, w), [x, w], [m.gate_up_proj, m.down_proj], dout)


@needs_hf
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "olmoe"])
def test_transformers_experts_forward_and_all_gradients(device, family):
    dhf.register()
    m, cfg = hf_experts(family, device)
    assert dhf.unsupported_reason(m) is None
    g = gen()
    T, K = 150, 2
    x = randn(T, D, g=g, device=device).requires_grad_()
    ids, w = hf_routing(T, K, device, g)
    dout = randn(T, D, g=g, device=device)
    want = hf_run(m, cfg, "eager", x, ids, w, dout)
    got = hf_run(m, cfg, "smoe", x, ids, w, dout)
    compare(["out", "dx", "dtop_k_weights", "dgate_up_proj", "ddown_proj"], got, want)
    again = hf_run(m, cfg, "smoe", x, ids, w, dout)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "not bitwise deterministic"


@needs_hf
@pytest.mark.skipif(HAVE_HF and not _hf_at_least(HF_PINNED),
                    reason=f"transformers {HF_VERSION}'s eager experts forward does not skip the EP sentinel "
                           f"(the reference here); {HF_PINNED} does")
def test_transformers_expert_parallel_sentinels(device):
    dhf.register()
    m, cfg = hf_experts("qwen3_moe", device)
    m._is_expert_parallel = True
    g = gen()
    T, K = 120, 2
    x = randn(T, D, g=g, device=device).requires_grad_()
    ids, w = hf_routing(T, K, device, g, sentinels=30)
    dout = randn(T, D, g=g, device=device)
    want = hf_run(m, cfg, "eager", x, ids, w, dout)  # eager skips id == num_experts
    got = hf_run(m, cfg, "smoe", x, ids, w, dout)
    compare(["out", "dx", "dtop_k_weights", "dgate_up_proj", "ddown_proj"], got, want)


@needs_hf
def test_transformers_whole_model_via_the_registry(device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    dhf.register()
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen())))
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=D, intermediate_size=2 * N, moe_intermediate_size=N,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         num_experts=E, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         experts_implementation="eager")
    model = Qwen3MoeForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 40), generator=gen()).to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads():
        for p in params:
            p.grad = None
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.logits.detach()] + [p.grad for p in params]
    want = loss_and_grads()
    model.set_experts_implementation("smoe")
    assert model.config._experts_implementation == "smoe"
    assert all(mod.config._experts_implementation == "smoe" for mod in model.modules()
               if type(mod).__name__ == "Qwen3MoeExperts")
    got = loss_and_grads()
    names = ["logits"] + [n for n, p in model.named_parameters() if p.requires_grad]
    # one layer: the router's input is the same in both runs (no top-K flips downstream of a difference)
    compare(names, got, want)


@needs_hf
def test_transformers_gpt_oss_is_refused_or_falls_back(device):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    cfg = GptOssConfig(hidden_size=D, intermediate_size=N, num_local_experts=E, num_experts_per_tok=2)
    m = GptOssExperts(cfg).to(device)
    g = gen()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    assert dhf.unsupported_reason(m) is not None
    T = 20
    x = torch.randn(T, D, generator=g).to(device)
    ids, w = hf_routing(T, 2, device, g)
    w = w.detach().float()
    try:
        dhf.register()
        cfg._experts_implementation = "smoe"
        with pytest.raises(ValueError, match="does not cover GptOssExperts"):
            m(x, ids, w)
        dhf.register(fallback="eager")
        got = m(x, ids, w)
        cfg._experts_implementation = "eager"
        want = m(x, ids, w)
        assert torch.equal(got, want)
    finally:
        dhf.register()


@needs_hf
def test_transformers_state_dict_is_untouched_by_the_switch():
    dhf.register()
    m, cfg = hf_experts("qwen3_moe", "cpu")
    cfg._experts_implementation = "eager"
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    cfg._experts_implementation = "smoe"
    assert list(m.state_dict()) == list(sd) == ["gate_up_proj", "down_proj"]
    fresh, _ = hf_experts("qwen3_moe", "cpu")
    fresh.load_state_dict(m.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_transformers_twin_wiring_without_transformers(device, monkeypatch):
    """The token-major -> expert-major -> token-major wiring against the twin of the eager forward
    (runs even where transformers is not installed)."""
    import smoe_torch.dropins.transformers as dhf_mod
    m = tw.TransformersExpertsTwin(E, D, N)
    g = gen()
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * D ** -0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * N ** -0.5)
    m = m.to(device=device, dtype=torch.bfloat16)
    T, K = 100, 4
    x = randn(T, D, g=g, device=device).requires_grad_()
    ids, w = hf_routing(T, K, device, g)
    dout = randn(T, D, g=g, device=device)
    params = [m.gate_up_proj, m.down_proj]
    want = run(lambda: tw.transformers_eager_experts_forward(m, x, ids, w), [x, w], params, dout)
    got = run(lambda: dhf_mod.smoe_experts_forward(m, x, ids, w), [x, w], params, dout)
    compare(["out", "dx", "dtop_k_weights", "dgate_up_proj", "ddown_proj"], got, want)


def test_framework_sources_used():
    """Not a check: records (in -rA output) which references the comparisons used here."""
    print(f"ref={REF_NAME} torchtitan={TT_SRC} megatron={MEG_SRC} megatron_te={meg_kind_src('te')} "
          f"transformers={'transformers' if HAVE_HF else 'absent'} gpu={'yes' if not _GPU_SKIP else _GPU_SKIP}")
