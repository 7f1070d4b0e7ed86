"""smoe_torch: the smoe Hopper MoE kernels as PyTorch custom ops, with autograd and a module.

Ops (torch.ops.smoe, CUDA, bf16):
  moe_forward(x [T,d], w_router [E,d], w1 [E,2n,d] interleaved, w2 [E,d,n], top_k) -> (out, saved)
  moe_backward(dout, x, w_router, w1, w2, saved, top_k) -> (dx, dw_router, dw1, dw2)
  topk_routing(logits [T,E] f32|bf16, top_k) -> [scores, topk_expert, expert_frequency,
                                                 expert_offset, scatter, reverse_scatter, gather]
  moe_forward_routed(x, w1, w2, expert [T,K] i32 (-1 = empty slot), scores [T,K] f32) -> (out, saved)
      caller-provided routing (any router in torch); autograd returns d/dscores (and d/dx of the
      expert path: the router's own part flows through the caller's scores)
  moe_backward_routed(dout, x, w1, w2, saved, top_k) -> (dx, dw1, dw2, dscores)
  moe_forward_tr(x, w_router, w1, w2, top_k, rounding, seed) -> (out, saved)   token rounding
      (rounding 0 NR, 1 UP, 2 DOWN, 3 SR; tile = _C.token_rounding_tile())
  moe_backward_tr(dout, x, w_router, w1, w2, saved, top_k, rounding) -> (dx, dw_router, dw1, dw2)
Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them;
moe_forward has autograd registered (backward = moe_backward). `saved` is an opaque uint8 tensor
(H [TK,2n] bf16 + routing metadata: 4TKn + O(TK) bytes): that plus references to x and the
weights is all autograd keeps for backward.
"""
import torch

from . import _C  # noqa: F401  (registers torch.ops.smoe.*)
from .moe import MoE, GroupedExperts, TokenChoiceTopKRouter, moe_forward_interleaved  # noqa: F401

ops = torch.ops.smoe


ROUNDING_MODES = {"nr": 0, "up": 1, "down": 2, "sr": 3}


def _saved_fake(x, E, n, K, router=0, rounding=0):
    T, d = x.shape
    return x.new_empty((_C.saved_state_size(T, d, n, E, K, router, rounding),), dtype=torch.uint8)


@torch.library.register_fake("smoe::moe_forward")
def _moe_forward_fake(x, w_router, w1, w2, top_k):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k)


@torch.library.register_fake("smoe::moe_forward_tr")
def _moe_forward_tr_fake(x, w_router, w1, w2, top_k, rounding, seed):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k, 1, rounding)


@torch.library.register_fake("smoe::moe_forward_routed")
def _moe_forward_routed_fake(x, w1, w2, expert, scores):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], expert.shape[1], 2)


@torch.library.register_fake("smoe::moe_backward_routed")
def _moe_backward_routed_fake(dout, x, w1, w2, saved, top_k):
    return (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2),
            x.new_empty((x.shape[0], top_k), dtype=torch.float32))


@torch.library.register_fake("smoe::moe_backward_tr")
def _moe_backward_tr_fake(dout, x, w_router, w1, w2, saved, top_k, rounding):
    return torch.empty_like(x), torch.empty_like(w_router), torch.empty_like(w1), torch.empty_like(w2)


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


def _setup_context_tr(ctx, inputs, output):
    x, w_router, w1, w2, top_k, rounding, _seed = inputs
    ctx.save_for_backward(x, w_router, w1, w2, output[1])
    ctx.top_k, ctx.rounding = top_k, rounding
    ctx.mark_non_differentiable(output[1])


def _backward_tr(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward_tr(dout.contiguous(), x, w_router, w1, w2, saved, ctx.top_k, ctx.rounding)
    return dx, dwr, dw1, dw2, None, None, None


torch.library.register_autograd("smoe::moe_forward_tr", _backward_tr, setup_context=_setup_context_tr)


def _setup_context_routed(ctx, inputs, output):
    x, w1, w2, expert, _scores = inputs
    ctx.save_for_backward(x, w1, w2, output[1])
    ctx.top_k = expert.shape[1]
    ctx.mark_non_differentiable(output[1])


def _backward_routed(ctx, dout, _dsaved):
    x, w1, w2, saved = ctx.saved_tensors
    dx, dw1, dw2, dscores = ops.moe_backward_routed(dout.contiguous(), x, w1, w2, saved, ctx.top_k)
    return dx, dw1, dw2, None, dscores


torch.library.register_autograd("smoe::moe_forward_routed", _backward_routed, setup_context=_setup_context_routed)


def check_routing(expert, num_experts):
    """Host-side check of caller-provided routing ids (one device sync): ids in [-1, E) and no expert
    twice in a token. The kernels also check on the device (without a sync): a bad slot is dropped
    and flagged in nonfinite_status(); this raises instead, naming the first bad token."""
    bad = (expert < -1) | (expert >= num_experts)
    if bool(bad.any()):
        t = int(bad.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"smoe: expert ids must be in [-1, {num_experts}); token {t} has {expert[t].tolist()}")
    srt = expert.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"smoe: token {t} lists an expert twice: {expert[t].tolist()}")


def moe_routed(x, w1_interleaved, w2, expert, scores, validate=True):
    """out[t] = sum over t's slots k with expert[t,k] >= 0 of scores[t,k] * SwiGLU expert(x[t]).

    Any router written in torch trains through this: gradients flow to x (expert path), the
    weights and `scores` (so to the router through the caller's own autograd graph). expert
    [T, K] int (-1 = empty slot), scores [T, K] float. validate=True checks the ids on the host
    (one sync); with validate=False bad ids are dropped on the device and flagged."""
    expert = expert.to(torch.int32).contiguous()
    if validate:
        check_routing(expert, w1_interleaved.shape[0])
    out, _saved = ops.moe_forward_routed(x, w1_interleaved, w2, expert, scores.float().contiguous())
    return out


def moe_token_rounding(x, w_router, w1_interleaved, w2, top_k, rounding="nr", seed=0):
    """The top-K softmax layer with SonicMoE token rounding of every expert's rows to the GEMM tile."""
    out, _saved = ops.moe_forward_tr(x, w_router, w1_interleaved, w2, top_k, ROUNDING_MODES[rounding], seed)
    return out


def nonfinite_status(device=None):
    """(flags, nonfinite_tokens, first_token) of the sticky device status. Reading it syncs."""
    like = torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device()))
    raw = _C.nonfinite_status(like).cpu()
    flags = int(raw[0:4].view(torch.int32).item()) & 0xFFFFFFFF
    count = int(raw[4:8].view(torch.int32).item()) & 0xFFFFFFFF
    first = int(raw[8:16].view(torch.int64).item())
    return flags, count, first
