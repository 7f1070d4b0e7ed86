"""Megatron-Core 0.16.1: its grouped expert MLP on the expert-major layer.

What Megatron-Core 0.16.1 has (megatron/core/transformer/moe/experts.py):
  * `GroupedMLP.forward(permuted_local_hidden_states [R, d], tokens_per_expert [E_local],
    permuted_probs [R]) -> (output [R, d], None)`, and the same for `TEGroupedMLP` and
    `SequentialMLP`; MoELayer calls `self.experts(dispatched_input, tokens_per_expert, permuted_probs)`.
    tokens_per_expert is a CPU int64 tensor from the all-to-all / all-gather dispatchers with a sync
    (TEGroupedMLP calls .tolist() on it), a device tensor from the sync-free paths.
  * weights (per rank: E = num_local_experts, n = moe_ffn_hidden_size / expert-TP size, d = hidden_size):
      GroupedMLP (legacy, --moe-use-legacy-grouped-gemm): `weight1` [d, E*2n], `weight2` [E*n, d];
        forward reinterprets them as `weight1.view(E, d, 2n)` and `weight2.view(E, n, d)` and runs
        `gmm(x, w1)` / `gmm(h, w2)` (x @ w, no transpose): expert e's fc1 is a [d, 2n] block.
      TEGroupedMLP (default with TE): `linear_fc1.weight0..weight{E-1}` each [2n, d] and
        `linear_fc2.weight0..weight{E-1}` each [d, n] (TE GroupedLinear, out x in, y = x @ w^T).
  * gated_linear_unit: `x_glu, x_linear = torch.chunk(fc1_out, 2, dim=-1)`, act(x_glu) * x_linear:
    the fc1 output is CONCATENATED [gate; up] (gate = first n columns), not interleaved;
  * probs: `activation(fc1_out) * permuted_probs.unsqueeze(-1)` (cast back to the activation dtype)
    BEFORE fc2 - the expert-major layer's `probs` order. With `moe_apply_probs_on_input` (top-1 only)
    x is scaled by the probs first and the probs become ones.
  * not plain SwiGLU (not covered here): no GLU, activation other than silu, `add_bias_linear`,
    `activation_func_clamp_value` / `glu_linear_offset` (gpt-oss style), `moe_latent_size`,
    fp8 / fp4, `use_te_activation_func`.

Layouts and copies. The expert-major layer takes w1 [E, 2n, d] "concatenated" (rows [0, n) gate)
and w2 [E, d, n], contiguous:
  * expert-major tensors ([E, 2n, d], [E, d, n]): passed as they are, no copy;
  * TEGroupedMLP's per-expert weights: each is already an expert's [2n, d] / [d, n] block, but they are
    E separate Parameters, so one torch.stack per projection is needed;
  * GroupedMLP's weight1 / weight2: the per-expert blocks are [d, 2n] / [n, d], the transposes of
    what the layer reads, so one transposing copy per projection is needed.
  These copies are explicit (`expert_major_weights`) and differentiable: gradients flow back through
  the copy into the Megatron parameters' own layout (`.grad`; Megatron's DDP hooks then add it to
  main_grad, also for TE's gradient_accumulation_fusion parameters). Default (cache=False): one copy
  per forward, alive until its backward (like an activation). cache=True: the copy is kept on the
  first weight (`param._smoe_em_cache`) keyed by (data_ptr, `_version`, shape, dtype) of every
  weight, and reused until the weight changes, so gradient-accumulation micro-batches and activation
  recomputation do not copy again (one extra bf16 copy of the layer's expert weights stays resident).
  CAUTION: a write that does not go through the Parameter does not change its `_version`. Megatron's
  DistributedOptimizer does exactly that (it sets `param.data` to a view of the DDP param buffer and
  all-gathers / copies the updated weights into that buffer), so with it use cache=False, or call
  clear_weight_cache(model) after every optimizer step (before the next forward).
"""
import types

import torch
import torch.nn.functional as F

from . import device_counts, expert_major


class _Relayout(torch.autograd.Function):
    """Megatron weights -> expert-major [E, rows, cols] (a copy, cached by weight version)."""

    @staticmethod
    def forward(ctx, kind, num_experts, cache, *weights):
        ctx.kind, ctx.num_experts = kind, num_experts
        ctx.shapes = [w.shape for w in weights]
        ctx.dtypes = [w.dtype for w in weights]
        key = tuple((w.data_ptr(), w._version, tuple(w.shape), w.dtype) for w in weights)
        owner = weights[0]
        hit = getattr(owner, "_smoe_em_cache", None) if cache else None
        if hit is not None and hit[0] == key:
            out = hit[1]
        else:
            out = _relayout(kind, num_experts, weights).to(torch.bfloat16).contiguous()
            if cache:
                owner._smoe_em_cache = (key, out)
        return out.detach()  # a fresh tensor object per call (autograd sets its grad_fn)

    @staticmethod
    def backward(ctx, g):
        if ctx.kind in ("fc1_te", "fc2_te"):  # g [E, rows, cols] -> E grads [rows, cols]
            grads = [gi.reshape(s) for gi, s in zip(g.unbind(0), ctx.shapes)]
        else:
            # fc1_legacy: g [E, 2n, d] -> [E, d, 2n] = weight1's memory [d, E*2n] (its view(E, d, 2n));
            # fc2_legacy: g [E, d, n] -> [E, n, d] = weight2's memory [E*n, d]
            grads = [g.transpose(1, 2).contiguous().view(ctx.shapes[0])]
        grads = [gi.to(dt) for gi, dt in zip(grads, ctx.dtypes)]
        return (None, None, None, *grads)


def _relayout(kind, E, weights):
    if kind in ("fc1_te", "fc2_te"):
        return torch.stack(list(weights), 0)
    (w,) = weights
    if kind == "fc1_legacy":  # weight1 [d, E*2n] viewed [E, d, 2n] -> [E, 2n, d]
        return w.view(E, w.shape[0], -1).transpose(1, 2)
    return w.view(E, -1, w.shape[1]).transpose(1, 2)  # weight2 [E*n, d] viewed [E, n, d] -> [E, d, n]


def expert_major_weights(fc1_weight, fc2_weight, num_local_experts=None, cache=False):
    """(w1 [E, 2n, d] concatenated gate/up, w2 [E, d, n]) from Megatron's fc1 / fc2 weights.

    fc1_weight / fc2_weight: GroupedMLP's weight1 [d, E*2n] / weight2 [E*n, d] (num_local_experts
    required), or TEGroupedMLP's per-expert lists [linear_fc1.weight{i} [2n, d]] / [linear_fc2.weight{i}
    [d, n]], or already expert-major 3-D tensors (returned as they are, no copy). Copies are differentiable
    and cached by weight version (see the module docstring).
    """
    if isinstance(fc1_weight, (list, tuple)):
        E = len(fc1_weight)
        w1 = _Relayout.apply("fc1_te", E, cache, *fc1_weight)
    elif fc1_weight.dim() == 3:
        E, w1 = fc1_weight.shape[0], fc1_weight
    else:
        if num_local_experts is None:
            raise ValueError("GroupedMLP's 2-D weight1 needs num_local_experts")
        E = num_local_experts
        w1 = _Relayout.apply("fc1_legacy", E, cache, fc1_weight)
    if isinstance(fc2_weight, (list, tuple)):
        if len(fc2_weight) != E:
            raise ValueError(f"fc2 has {len(fc2_weight)} expert weights, fc1 {E}")
        w2 = _Relayout.apply("fc2_te", E, cache, *fc2_weight)
    elif fc2_weight.dim() == 3:
        w2 = fc2_weight
    else:
        w2 = _Relayout.apply("fc2_legacy", E, cache, fc2_weight)
    if w1.shape[0] != E or w2.shape[0] != E or w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1]:
        raise ValueError(f"fc1 / fc2 shapes do not make a SwiGLU expert pair: w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)} (want [E, 2n, d], [E, d, n])")
    return w1, w2


def megatron_grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1_weight, fc2_weight,
                         *, num_local_experts=None, apply_probs_on_input=False, cache=False):
    """Megatron-Core's grouped expert MLP (SwiGLU, no bias) on smoe_torch.expert_major.

    Inputs and outputs as GroupedMLP / TEGroupedMLP.forward: permuted_local_hidden_states [R, d] (rows
    grouped by local expert), tokens_per_expert [E] (CPU or device, any int dtype: made int32 on x's
    device), permuted_probs [R] (any float dtype; applied before fc2) -> (output [R, d], None).
    fc1_weight / fc2_weight: see expert_major_weights (which says where a copy is made).
    apply_probs_on_input: Megatron's moe_apply_probs_on_input (x scaled by the probs, then probs = 1).
    """
    x = permuted_local_hidden_states
    w1, w2 = expert_major_weights(fc1_weight, fc2_weight, num_local_experts, cache)
    probs = permuted_probs.reshape(-1) if permuted_probs is not None else None
    if apply_probs_on_input and probs is not None:
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = None
    if x.shape[0] == 0:
        # As Megatron: the experts' weights still get (zero) gradients when no row is routed here.
        out = x.new_zeros((0, w2.shape[1])) + 0 * (w1.sum() + w2.sum()).to(x.dtype)
        return out, None
    counts = device_counts(tokens_per_expert, x.device)
    out = expert_major(x.to(torch.bfloat16), counts, w1, w2, probs=None if probs is None else probs.float(),
                       gate_up="concatenated")
    return out.to(x.dtype), None


def _check_config(config):
    """Raise unless the module's TransformerConfig describes what the expert-major layer computes."""
    bad = []
    if not getattr(config, "gated_linear_unit", False):
        bad.append("gated_linear_unit=False (the layer is SwiGLU only)")
    if getattr(config, "activation_func", F.silu) is not F.silu:
        bad.append(f"activation_func={getattr(config.activation_func, '__name__', config.activation_func)} (silu only)")
    if getattr(config, "add_bias_linear", False):
        bad.append("add_bias_linear=True (no expert biases)")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        bad.append("activation_func_clamp_value (clamped SwiGLU)")
    if getattr(config, "glu_linear_offset", 0.0):
        bad.append("glu_linear_offset != 0")
    if getattr(config, "moe_latent_size", None) is not None:
        bad.append("moe_latent_size (latent projection)")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        bad.append("fp8 / fp4")
    if getattr(config, "use_te_activation_func", False):
        bad.append("use_te_activation_func")
    if bad:
        raise ValueError("smoe megatron drop-in: unsupported expert config: " + "; ".join(bad))


def module_weights(module):
    """(fc1_weight, fc2_weight, num_local_experts) of a GroupedMLP or TEGroupedMLP instance."""
    E = module.num_local_experts
    if hasattr(module, "weight1"):
        return module.weight1, module.weight2, E
    fc1 = [getattr(module.linear_fc1, f"weight{i}") for i in range(E)]
    fc2 = [getattr(module.linear_fc2, f"weight{i}") for i in range(E)]
    return fc1, fc2, E


def megatron_experts_forward(module, permuted_local_hidden_states, tokens_per_expert, permuted_probs, cache=False):
    """GroupedMLP / TEGroupedMLP.forward of `module`, on the expert-major layer."""
    _check_config(module.config)
    fc1, fc2, E = module_weights(module)
    return megatron_grouped_mlp(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1, fc2,
                                num_local_experts=E, cache=cache,
                                apply_probs_on_input=getattr(module.config, "moe_apply_probs_on_input", False))


def clear_weight_cache(*objs):
    """Drop the cached expert-major weight copies held by these tensors / in these modules."""
    for o in objs:
        params = o.parameters() if isinstance(o, torch.nn.Module) else (o if isinstance(o, (list, tuple)) else [o])
        for p in params:
            if hasattr(p, "_smoe_em_cache"):
                del p._smoe_em_cache


def megatron_expert_classes():
    """Megatron-Core's GroupedMLP and TEGroupedMLP classes (an empty tuple without megatron-core)."""
    try:
        from megatron.core.transformer.moe import experts
    except Exception:  # noqa: BLE001
        return ()
    return tuple(c for c in (getattr(experts, "GroupedMLP", None), getattr(experts, "TEGroupedMLP", None)) if c)


def patch_megatron_experts(model, cache=False, classes=None):
    """Route every GroupedMLP / TEGroupedMLP in `model` through the expert-major layer; returns how many.

    Sets an instance-level `forward` (nothing else changes: the same Parameters, state-dict and
    sharded-state-dict keys, DDP hooks, backward_dw). Checks each module's config first (raises if
    it is not plain SwiGLU without bias). Undo with `del module.forward`. classes: the module classes
    to patch (default megatron_expert_classes()).
    """
    classes = tuple(classes) if classes is not None else megatron_expert_classes()
    if not classes:
        raise ImportError("patch_megatron_experts: megatron-core is not importable (or pass classes=...)")
    n = 0
    for m in model.modules():
        if isinstance(m, classes) and "forward" not in m.__dict__:
            _check_config(m.config)
            m.forward = types.MethodType(
                lambda self, x, tpe, probs, _c=cache: megatron_experts_forward(self, x, tpe, probs, cache=_c), m)
            n += 1
    return n
