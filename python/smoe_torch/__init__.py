"""smoe_torch: the smoe Hopper MoE kernels as PyTorch custom ops, with autograd and a module.

Ops (torch.ops.smoe, CUDA, bf16):
  moe_forward(x [T,d], w_router [E,d], w1 [E,2n,d] interleaved, w2 [E,d,n], top_k, w3=None) -> (out, saved)
  moe_backward(dout, x, w_router, w1, w2, saved, top_k, w3=None) -> (dx, dw_router, dw1, dw2)
      w3 (every layer op, last): gate/up as two tensors, w1 (gate) and w3 (up) [E,n,d] (torchtitan's
      layout, read in place); the backward's dw1 is then [2,E,n,d] = (dw1, dw3)
  topk_routing(logits [T,E] f32|bf16, top_k) -> [scores, topk_expert, expert_frequency,
                                                 expert_offset, scatter, reverse_scatter, gather]
  moe_forward_routed(x, w1, w2, expert [T,K] i32 (-1 = empty slot), scores [T,K] f32) -> (out, saved)
      caller-provided routing (any router in torch); autograd returns d/dscores (and d/dx of the
      expert path: the router's own part flows through the caller's scores)
  moe_backward_routed(dout, x, w1, w2, saved, top_k) -> (dx, dw1, dw2, dscores)
  moe_forward_tr(x, w_router, w1, w2, top_k, rounding, seed) -> (out, saved)   token rounding
      (rounding 0 NR, 1 UP, 2 DOWN, 3 SR; tile = _C.token_rounding_tile())
  moe_backward_tr(dout, x, w_router, w1, w2, saved, top_k, rounding) -> (dx, dw_router, dw1, dw2)
Expert-major layer (rows already grouped by expert: torchtitan / Megatron-Core / DeepEP dispatchers):
  expert_major(x [R,d], counts [E], w1, w2, w3=None, *, probs=None, segment_offset=None, gate_up=None)
      -> out [R,d], autograd over expert_major_fwd / expert_major_bwd (csrc/expert_major_ops.cpp);
      expert_major_ref: its pure-torch twin (any device). Details and the status helpers in
      expert_major.py (`from smoe_torch.expert_major import ...`: smoe_torch.expert_major is the function)
Expert parallelism (one node, NCCL device API): smoe_torch.ep (EpGroup, ep_moe; ops
  ep_forward(ctx, x, expert, scores, w1_local, w2_local) and ep_backward), and MoE(ep_group=...).
Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them;
moe_forward, moe_forward_tr, moe_forward_routed and ep_forward have autograd registered (backward =
the matching backward op). `saved` is an opaque uint8 tensor (H [TK,2n] bf16 + routing metadata:
4TKn + O(TK) bytes): that plus references to x and the weights is all autograd keeps for backward.
The three backward ops take consume_saved=False last: True writes dH over the saved H (4TKn bytes
less at the backward's peak) and spends the state (a later backward on it gives NaN gradients and a
raise_if_nonfinite() error). Autograd passes True only in an eager backward that does not keep the graph (retain_graph, which
create_graph turns on unless told otherwise; _ops._consume_saved); SMOE_CONSUME_SAVED=0 at import turns that off.

This module only re-exports. Where things live: _ops.py loads the extension (_C) and registers the
ops' fakes and autograd (and the EP ops', via load_ep); _layout.py computes the saved-state sizes the
fakes need (saved_state_bytes, mirrored from src/moe/memory_plan.cpp and src/ep/ep_layer.cpp);
_runtime.py has the device-status helpers and init; moe.py the module and functional helpers;
packing.py the packed gate/up parameters; ep.py expert parallelism (imported on demand).
"""
from . import _ops  # noqa: F401  (loads _C: torch.ops.smoe.*, with their fakes and autograd)
from . import _C  # noqa: F401  (already loaded by _ops; smoe_torch._C stays the extension module)
from ._layout import saved_state_bytes  # noqa: F401
from ._ops import ops  # noqa: F401  (torch.ops.smoe)
from ._runtime import init, nonfinite_status, raise_if_nonfinite, reset_nonfinite_status  # noqa: F401
from .expert_major import expert_major, expert_major_ref  # noqa: F401
from .moe import (MoE, GroupedExperts, SharedExperts, TokenChoiceTopKRouter, ROUNDING_MODES,  # noqa: F401
                  check_routing, moe_forward_interleaved, moe_routed, moe_token_rounding)
