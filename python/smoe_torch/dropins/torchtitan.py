"""torchtitan 0.3.0: its routed experts (`GroupedExperts`) on the expert-major layer.

What torchtitan 0.3.0 has (torchtitan/models/common/moe.py, class GroupedExperts(Module)):
  * built from a config: `GroupedExperts.Config(dim, hidden_dim, num_experts, param_init=None,
    sharding_config=None)` (kw-only slots dataclass), `GroupedExperts(config)` / `config.build()`;
  * parameters `w1_EFD` (gate) [E, F, D], `w2_EDF` (down) [E, D, F], `w3_EFD` (up) [E, F, D]; no
    init_weights: `Module.init_states()` initialises them from `Config.param_init` (a dict keyed by
    those names), sharding comes from `Config.sharding_config` (FSDP / EP / TP placements keyed by
    the same names);
  * `forward(x_RD, num_tokens_per_expert_E)`: rows grouped by expert, counts a device tensor [E]; DTensor
    weights are `.to_local()`-ed; x and the weights are cast to bf16, then
    `silu(x @ w1^T) * (x @ w3^T) @ w2^T` through `torch._grouped_mm(offs=cumsum(counts))` and the
    result `.type_as(x)`;
  * padding: the bf16 dispatchers hand it exactly sum(counts) rows; TorchAOTokenDispatcher
    (`pad_multiple`, for fp8 / mxfp8) and HybridEP (`pad_multiple`) pad each expert's group and pass
    the padded counts (the padding rows are part of their expert's rows, as in torchtitan); HybridEP's
    non-blocking capacity mode passes R > sum(counts) rows: the tail past sum(counts) is padding,
    which the expert-major layer leaves as zero rows at no GEMM cost;
  * an override hook: `@torchtitan.config.override(target=GroupedExperts.Config, ...)` registers a
    factory `cfg -> new Config`, activated by `--override.imports module.function` (the
    `[override] imports` list in a config); see torchtitan/overrides/fused_swiglu.py.

What this module gives:
  * `SmoeGroupedExperts` - a GroupedExperts subclass (same constructor, parameters, state-dict keys,
    param_init and sharding configs), whose forward calls smoe_torch.expert_major(gate_up="separate",
    w1 = gate, w3 = up: torchtitan's tensors are read in place, no stack or copy);
  * `smoe_grouped_experts` - the @override factory:
        --override.imports smoe_torch.dropins.torchtitan.smoe_grouped_experts
    (exact=True: only stock GroupedExperts configs; gpt-oss's and the float8 / mxfp8 ones stay);
  * `swap_grouped_experts(model)` - for an already built model: switches every stock GroupedExperts
    instance (also one that fully_shard / checkpoint wrappers already wrapped) to the smoe forward in
    place, by changing the instance's class; the Parameter objects are untouched, so optimizer,
    FSDP2 and checkpoint state stay valid;
  * `grouped_experts_forward(w1, w2, w3, x, counts)` - the functional form.
Without torchtitan installed, `SmoeGroupedExperts` is a plain nn.Module with the same parameter names
(SmoeGroupedExperts(SmoeGroupedExperts.Config(dim=..., hidden_dim=..., num_experts=...))).
"""
from dataclasses import dataclass

import torch
from torch import nn

from . import device_counts, expert_major

try:  # the real package; everything below also works without it
    from torchtitan.models.common.moe import GroupedExperts as _TTGroupedExperts
    from torchtitan.config import derive as _derive, override as _override
    HAVE_TORCHTITAN = True
except Exception:  # noqa: BLE001  (not installed, or a version whose layout differs)
    _TTGroupedExperts = None
    HAVE_TORCHTITAN = False


def _to_local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def grouped_experts_forward(w1, w2, w3, x, num_tokens_per_expert):
    """torchtitan's GroupedExperts.forward math on the expert-major layer.

    w1 (gate) / w3 (up) [E, F, D], w2 [E, D, F] (DTensors are to_local()-ed), x [R, D] grouped by
    expert, num_tokens_per_expert [E] (any int dtype, any device: made int32 on x's device). As
    torchtitan: x and the weights go in as bf16 (a no-op when they already are), out is cast to x's dtype.
    """
    w1, w2, w3 = _to_local(w1), _to_local(w2), _to_local(w3)
    counts = device_counts(num_tokens_per_expert, x.device)
    out = expert_major(x.bfloat16(), counts, w1.bfloat16(), w2.bfloat16(), w3.bfloat16(), gate_up="separate")
    return out.type_as(x)


class _SmoeForward:
    """The forward that every smoe variant of GroupedExperts shares (first in the MRO)."""

    def forward(self, x_RD, num_tokens_per_expert_E):
        return grouped_experts_forward(self.w1_EFD, self.w2_EDF, self.w3_EFD, x_RD, num_tokens_per_expert_E)


if HAVE_TORCHTITAN:
    class SmoeGroupedExperts(_SmoeForward, _TTGroupedExperts):
        """torchtitan's GroupedExperts with the forward on smoe_torch.expert_major."""

        @dataclass(kw_only=True, slots=True)
        class Config(_TTGroupedExperts.Config):
            pass

        forward = _SmoeForward.forward

    @_override(target=_TTGroupedExperts.Config, exact=True,
               description="smoe expert-major kernels for the routed experts (GroupedExperts)")
    def smoe_grouped_experts(cfg):
        """--override.imports smoe_torch.dropins.torchtitan.smoe_grouped_experts"""
        return _derive(cfg, SmoeGroupedExperts.Config)
else:
    class SmoeGroupedExperts(_SmoeForward, nn.Module):
        """Stand-in with torchtitan 0.3.0's parameter names, for use without torchtitan."""

        @dataclass(kw_only=True)
        class Config:
            dim: int
            hidden_dim: int
            num_experts: int

            def build(self):
                return SmoeGroupedExperts(self)

        def __init__(self, config):
            super().__init__()
            self.num_experts = config.num_experts
            self.w1_EFD = nn.Parameter(torch.empty(config.num_experts, config.hidden_dim, config.dim))
            self.w2_EDF = nn.Parameter(torch.empty(config.num_experts, config.dim, config.hidden_dim))
            self.w3_EFD = nn.Parameter(torch.empty(config.num_experts, config.hidden_dim, config.dim))

        forward = _SmoeForward.forward

    def smoe_grouped_experts(cfg):
        raise ImportError("smoe_grouped_experts is a torchtitan @override: torchtitan is not importable")


_SWAPPED = {}


def _smoe_class(cls):
    """`cls` (GroupedExperts or a wrapper class around it, e.g. FSDP2's FSDPGroupedExperts) with the
    smoe forward first in the MRO; one class per cls."""
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"Smoe{cls.__name__}", (_SmoeForward, cls), {"forward": _SmoeForward.forward})
    return _SWAPPED[cls]


def swap_grouped_experts(model, base=None):
    """Switch every stock GroupedExperts in `model` to the smoe forward, in place; returns how many.

    An instance is switched when it is a `base` (default torchtitan's GroupedExperts) whose forward is
    still the stock one (so gpt-oss's, the float8 / mxfp8 converters' and already swapped ones are
    left alone). Only the instance's class changes: parameters (the same Parameter objects), buffers,
    hooks, FSDP2 state and state-dict keys stay as they are.
    """
    base = base or _TTGroupedExperts
    if base is None:
        raise ImportError("swap_grouped_experts needs torchtitan (or base=<the GroupedExperts class>)")
    n = 0
    for m in model.modules():
        if isinstance(m, base) and not isinstance(m, _SmoeForward) and type(m).forward is base.forward:
            m.__class__ = _smoe_class(type(m))
            n += 1
    return n
