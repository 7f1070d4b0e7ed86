"""transformers 5.24.0: an "smoe" experts implementation.

What transformers 5.24.0 has (transformers/integrations/moe.py):
  * `ExpertsInterface(GeneralInterface)`, instance `ALL_EXPERTS_FUNCTIONS`, built-ins "batched_mm",
    "grouped_mm" (the default), "deepgemm", "sonicmoe" (plus "eager" = the class's own forward);
    `ExpertsInterface.register(name, fn)` adds one for every model;
  * the experts classes are decorated with `@use_experts_implementation(is_concatenated=True,
    is_transposed=False, has_bias=False, has_gate=True, has_post_expert_norm=False)`, which sets
    those flags (and `_is_expert_parallel`) on the instance and makes `forward(hidden_states,
    top_k_index, top_k_weights)` call `fn(self, hidden_states, top_k_index, top_k_weights)` with
    fn = ALL_EXPERTS_FUNCTIONS.get_interface(self.config._experts_implementation, original forward);
  * the config attribute is `config._experts_implementation` (set by
    `from_pretrained(..., experts_implementation="smoe")`, `Config(experts_implementation=...)`, or
    `model.set_experts_implementation("smoe")`; checked against the registry's keys);
  * arguments: hidden_states [T, d] (token-major), top_k_index [T, K] int64 expert ids (under expert
    parallelism ids >= num_experts are sentinels with weight 0), top_k_weights [T, K]; the module
    holds `gate_up_proj` [E, 2n, d] (is_transposed=False; [E, d, 2n] when transposed) with gate rows
    [0, n) then up rows (is_concatenated=True; interleaved gate0, up0, gate1, ... when False),
    `down_proj` [E, d, n] ([E, n, d] transposed), `act_fn`, optional `*_bias`, `_apply_gate`
    (default: chunk(2) -> act_fn(gate) * up), `num_experts`. Returns [T, d] in hidden_states' dtype.

What "smoe" computes: the rows grouped by expert (stable argsort of the flattened top_k_index,
counts = bincount on the device, rows gathered), smoe_torch.expert_major with probs = the gathered
top_k_weights (applied before the down projection), then the rows put back in token order through the
inverse permutation and summed over K in fp32 (view [T, K, d]) - no float atomics anywhere, also not
in the backward (dx of the gather is the same inverse-permutation + sum). EP sentinels become padding
rows past sum(counts): no GEMM work, zero output.

Covered: gated experts with plain SwiGLU (act_fn silu, default _apply_gate), no bias, no post-expert
norm, not transposed, concatenated gate/up (read in place, no copy): Qwen2-MoE, Qwen3-MoE (and Qwen3-Next /
-VL-MoE / 3.5-MoE), Mixtral, DeepSeek-V2/V3, OLMoE, MiniMax, GLM-4-MoE, Dots1, HunYuan-MoE,
Ernie-4.5-MoE, GraniteMoE, Jamba, Kimi-Linear, LFM2-MoE, PhiMoE, ... (`unsupported_reason(module)` says
for a given module; the activation is checked at run time, so a config with hidden_act="gelu" is
refused). Not covered: gpt-oss (clamped SwiGLU with alpha 1.702, limit 7, the +1 on the linear half,
biases, transposed interleaved weights), DeepSeek-V4 / HY-V4 / Inkling2 / Beam (custom gates),
Aria (transposed), NemotronH (no gate), MuseSpark (post-expert norm), GELU variants. For those "smoe" raises a
ValueError naming the reason, or, after `register(fallback="grouped_mm")` (or "eager", "batched_mm"),
runs that implementation instead.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import expert_major

NAME = "smoe"
_FALLBACK = None


def unsupported_reason(module):
    """None if the expert-major layer computes exactly this experts module, else why not."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a stand-in module (tests without transformers): no _apply_gate = the default
        _default_apply_gate = None
    try:
        from transformers.activations import SiLUActivation
        silu = (nn.SiLU, SiLUActivation)
    except ImportError:
        silu = (nn.SiLU,)
    if not getattr(module, "has_gate", False):
        return "experts without a gate (has_gate=False)"
    if getattr(module, "has_bias", False):
        return "experts with biases (has_bias=True)"
    if getattr(module, "has_post_expert_norm", False):
        return "a post-expert norm"
    if getattr(module, "is_transposed", False):
        return "transposed expert weights (is_transposed=True)"
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"a custom gate activation ({type(module).__name__}._apply_gate, e.g. gpt-oss's clamped SwiGLU)"
    if not getattr(module, "is_concatenated", True):
        # transformers' default _apply_gate splits with chunk(2) whatever this flag says; only custom gates
        # (gpt-oss) read interleaved weights, so the flag has no plain-SwiGLU meaning to follow
        return "is_concatenated=False (interleaved gate/up)"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, silu) or act is F.silu):
        return f"activation {getattr(act, '__name__', type(act).__name__)} (SwiGLU = silu only)"
    from torch.distributed.tensor import DTensor
    if isinstance(module.gate_up_proj, DTensor) or isinstance(module.down_proj, DTensor):
        return "DTensor (tensor-parallel) expert weights"
    return None


class _GatherRows(torch.autograd.Function):
    """rows = x[perm // K]; backward sums each token's K row gradients through the inverse permutation
    (a gather and a sum over K in fp32: deterministic, no index_add / atomics)."""

    @staticmethod
    def forward(ctx, x, perm, inv_perm, K):
        ctx.save_for_backward(inv_perm)
        ctx.K = K
        return x.index_select(0, perm // K)

    @staticmethod
    def backward(ctx, g):
        (inv_perm,) = ctx.saved_tensors
        T = inv_perm.numel() // ctx.K
        dx = g.index_select(0, inv_perm).view(T, ctx.K, -1).float().sum(1).to(g.dtype)
        return dx, None, None, None


class _Permute(torch.autograd.Function):
    """y = x[idx] for a permutation idx (inverse inv); backward = g[inv] (a gather, not an index_add)."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None


def smoe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ExpertsInterface function: token-major in, token-major out, expert-major in between."""
    reason = unsupported_reason(self)
    if reason is not None:
        if _FALLBACK is not None:
            return _fallback(self, hidden_states, top_k_index, top_k_weights)
        raise ValueError(f"experts_implementation='{NAME}' does not cover {type(self).__name__}: {reason}. "
                         f"Use experts_implementation='grouped_mm' (or 'eager') for this model, or "
                         f"smoe_torch.dropins.transformers.register(fallback='grouped_mm').")
    T, K = top_k_index.shape
    E = self.num_experts
    dev = hidden_states.device
    ids = top_k_index.reshape(-1)
    perm = torch.argsort(ids, stable=True)  # rows of expert 0, 1, ..., then EP sentinels (ids >= E)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=dev)
    counts = torch.bincount(ids.clamp(0, E), minlength=E + 1)[:E].to(torch.int32)
    x = _GatherRows.apply(hidden_states.to(torch.bfloat16), perm, inv_perm, K)
    probs = _Permute.apply(top_k_weights.reshape(-1), perm, inv_perm).float()
    out = expert_major(x, counts, self.gate_up_proj.to(torch.bfloat16), self.down_proj.to(torch.bfloat16),
                       probs=probs, gate_up="concatenated")
    out = _Permute.apply(out, inv_perm, perm).view(T, K, -1).float().sum(1)
    return out.to(hidden_states.dtype)


def _fallback(self, hidden_states, top_k_index, top_k_weights):
    if _FALLBACK == "eager":
        original = getattr(type(self).forward, "__wrapped__", None)  # use_experts_implementation's @wraps
        if original is None:
            raise RuntimeError(f"no eager forward found on {type(self).__name__}")
        return original(self, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    return ALL_EXPERTS_FUNCTIONS[_FALLBACK](self, hidden_states, top_k_index, top_k_weights)


def register(name=NAME, fallback=None):
    """Register the implementation as `name` in transformers' ExpertsInterface (for every model).

    Then: `from_pretrained(..., experts_implementation="smoe")` or `model.set_experts_implementation("smoe")`.
    fallback: None (raise on experts the layer does not cover), or "eager" / "grouped_mm" / "batched_mm"
    to run that implementation for those experts instead.
    """
    global NAME, _FALLBACK
    if fallback not in (None, "eager", "grouped_mm", "batched_mm"):
        raise ValueError(f"fallback must be None, 'eager', 'grouped_mm' or 'batched_mm', not {fallback!r}")
    from transformers.integrations.moe import ExpertsInterface
    NAME, _FALLBACK = name, fallback
    ExpertsInterface.register(name, smoe_experts_forward)
    return name
