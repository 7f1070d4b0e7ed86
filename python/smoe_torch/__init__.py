"""smoe_torch: the smoe Hopper MoE kernels as PyTorch custom ops, with autograd and a module.

Ops (torch.ops.smoe, CUDA, bf16):
  moe_forward(x [T,d], w_router [E,d], w1 [E,2n,d] interleaved, w2 [E,d,n], top_k) -> (out, saved)
  moe_backward(dout, x, w_router, w1, w2, saved, top_k) -> (dx, dw_router, dw1, dw2)
  topk_routing(logits [T,E] f32|bf16, top_k) -> [scores, topk_expert, expert_frequency,
                                                 expert_offset, scatter, reverse_scatter, gather]
Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them;
moe_forward has autograd registered (backward = moe_backward). `saved` is an opaque uint8 tensor
(H [TK,2n] bf16 + routing metadata: 4TKn + O(TK) bytes): that plus references to x and the
weights is all autograd keeps for backward.
"""
import torch

from . import _C  # noqa: F401  (registers torch.ops.smoe.*)
from .moe import MoE, GroupedExperts, TokenChoiceTopKRouter, moe_forward_interleaved  # noqa: F401

ops = torch.ops.smoe


@torch.library.register_fake("smoe::moe_forward")
def _moe_forward_fake(x, w_router, w1, w2, top_k):
    T, d = x.shape
    E, n = w_router.shape[0], w2.shape[2]
    saved = x.new_empty((_C.saved_state_size(T, d, n, E, top_k),), dtype=torch.uint8)
    return torch.empty_like(x), saved


@torch.library.register_fake("smoe::moe_backward")
def _moe_backward_fake(dout, x, w_router, w1, w2, saved, top_k):
    return torch.empty_like(x), torch.empty_like(w_router), torch.empty_like(w1), torch.empty_like(w2)


@torch.library.register_fake("smoe::topk_routing")
def _topk_routing_fake(logits, top_k):
    T, E = logits.shape
    i32 = dict(dtype=torch.int32, device=logits.device)
    return [logits.new_empty((T, top_k), dtype=torch.float32), torch.empty((T, top_k), **i32),
            torch.empty((E,), **i32), torch.empty((E + 1,), **i32), torch.empty((T * top_k,), **i32),
            torch.empty((T * top_k,), **i32), torch.empty((T * top_k,), **i32)]


def _setup_context(ctx, inputs, output):
    x, w_router, w1, w2, top_k = inputs
    _, saved = output
    ctx.save_for_backward(x, w_router, w1, w2, saved)
    ctx.top_k = top_k
    ctx.mark_non_differentiable(saved)


def _backward(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward(dout.contiguous(), x, w_router, w1, w2, saved, ctx.top_k)
    return dx, dwr, dw1, dw2, None


torch.library.register_autograd("smoe::moe_forward", _backward, setup_context=_setup_context)


def nonfinite_status(device=None):
    """(flags, nonfinite_tokens, first_token) of the sticky device status. Reading it syncs."""
    like = torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device()))
    raw = _C.nonfinite_status(like).cpu()
    flags = int(raw[0:4].view(torch.int32).item()) & 0xFFFFFFFF
    count = int(raw[4:8].view(torch.int32).item()) & 0xFFFFFFFF
    first = int(raw[8:16].view(torch.int64).item())
    return flags, count, first
