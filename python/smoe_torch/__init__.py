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
Expert parallelism (one node, NCCL device API): smoe_torch.ep (EpGroup, ep_moe; ops
  ep_forward(ctx, x, expert, scores, w1_local, w2_local) and ep_backward), and MoE(ep_group=...).
Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them;
moe_forward has autograd registered (backward = moe_backward). `saved` is an opaque uint8 tensor
(H [TK,2n] bf16 + routing metadata: 4TKn + O(TK) bytes): that plus references to x and the
weights is all autograd keeps for backward.
"""
import torch

from . import _C  # noqa: F401  (registers torch.ops.smoe.*)
from .moe import (MoE, GroupedExperts, SharedExperts, TokenChoiceTopKRouter, ROUNDING_MODES,  # noqa: F401
                  check_routing, moe_forward_interleaved, moe_routed, moe_token_rounding)

ops = torch.ops.smoe


def _align(b):
    return (b + 255) // 256 * 256


def saved_state_bytes(T, n, E, K, router=0, rounding=0, tile=128):
    """moe_saved_state_size in Python (src/moe/memory_plan.cpp's layout, every region rounded to 256
    bytes), so that the fake impls stay symbolic in T: torch.compile(dynamic=True) compiles once for
    every sequence length instead of specialising on T. Tested against the C++ query."""
    tk = T * K
    rows = tk
    if router == 1 and rounding != 2:   # token rounding (not DOWN): worst case of the rounded counts
        rows = torch.sym_min(T * E, tk + E * (tile - 1))
    b = _align(32)                                  # the stamp (magic, shape hash, size)
    b += _align(rows * 2 * n * 2) + _align(rows * 4) + _align(tk * 4)
    if router == 1:
        b += _align(rows * 4) + _align(tk * 4)      # entry experts, top-K scores
    b += 3 * _align(rows * 4) + _align((T + 1) * 4) + _align(E * 4) + _align((E + 1) * 4)
    return b


def _saved_fake(x, E, n, K, router=0, rounding=0):
    T = x.shape[0]
    return x.new_empty((saved_state_bytes(T, n, E, K, router, rounding),), dtype=torch.uint8)


def _dw1_fake(w1, w3):
    """The backward's first-projection gradient: like w1, or [2, E, n, d] (dw1, dw3) with w3."""
    return torch.empty_like(w1) if w3 is None else w1.new_empty((2, *w1.shape))


@torch.library.register_fake("smoe::moe_forward")
def _moe_forward_fake(x, w_router, w1, w2, top_k, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k)


@torch.library.register_fake("smoe::moe_forward_tr")
def _moe_forward_tr_fake(x, w_router, w1, w2, top_k, rounding, seed, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k, 1, rounding)


@torch.library.register_fake("smoe::moe_forward_routed")
def _moe_forward_routed_fake(x, w1, w2, expert, scores, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], expert.shape[1], 2)


@torch.library.register_fake("smoe::moe_backward_routed")
def _moe_backward_routed_fake(dout, x, w1, w2, saved, top_k, w3=None):
    return (torch.empty_like(x), _dw1_fake(w1, w3), torch.empty_like(w2),
            x.new_empty((x.shape[0], top_k), dtype=torch.float32))


@torch.library.register_fake("smoe::moe_backward_tr")
def _moe_backward_tr_fake(dout, x, w_router, w1, w2, saved, top_k, rounding, w3=None):
    return torch.empty_like(x), torch.empty_like(w_router), _dw1_fake(w1, w3), torch.empty_like(w2)


@torch.library.register_fake("smoe::moe_backward")
def _moe_backward_fake(dout, x, w_router, w1, w2, saved, top_k, w3=None):
    return torch.empty_like(x), torch.empty_like(w_router), _dw1_fake(w1, w3), torch.empty_like(w2)


@torch.library.register_fake("smoe::topk_routing")
def _topk_routing_fake(logits, top_k):
    T, E = logits.shape
    i32 = dict(dtype=torch.int32, device=logits.device)
    return [logits.new_empty((T, top_k), dtype=torch.float32), torch.empty((T, top_k), **i32),
            torch.empty((E,), **i32), torch.empty((E + 1,), **i32), torch.empty((T * top_k,), **i32),
            torch.empty((T * top_k,), **i32), torch.empty((T * top_k,), **i32)]


def _split_dw1(dw1, w3):
    """(dw1, dw3) for autograd: the two halves of the [2, E, n, d] gradient with w3 (views)."""
    return (dw1, None) if w3 is None else (dw1[0], dw1[1])


def _setup_context(ctx, inputs, output):
    x, w_router, w1, w2, top_k, w3 = inputs
    _, saved = output
    ctx.save_for_backward(x, w_router, w1, w2, saved, w3)
    ctx.top_k = top_k
    ctx.mark_non_differentiable(saved)


def _backward(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward(dout.contiguous(), x, w_router, w1, w2, saved, ctx.top_k, w3)
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dwr, dw1, dw2, None, dw3


torch.library.register_autograd("smoe::moe_forward", _backward, setup_context=_setup_context)


def _setup_context_tr(ctx, inputs, output):
    x, w_router, w1, w2, top_k, rounding, _seed, w3 = inputs
    ctx.save_for_backward(x, w_router, w1, w2, output[1], w3)
    ctx.top_k, ctx.rounding = top_k, rounding
    ctx.mark_non_differentiable(output[1])


def _backward_tr(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward_tr(dout.contiguous(), x, w_router, w1, w2, saved, ctx.top_k, ctx.rounding, w3)
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dwr, dw1, dw2, None, None, None, dw3


torch.library.register_autograd("smoe::moe_forward_tr", _backward_tr, setup_context=_setup_context_tr)


def _setup_context_routed(ctx, inputs, output):
    x, w1, w2, expert, _scores, w3 = inputs
    ctx.save_for_backward(x, w1, w2, output[1], w3)
    ctx.top_k = expert.shape[1]
    ctx.mark_non_differentiable(output[1])


def _backward_routed(ctx, dout, _dsaved):
    x, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dw1, dw2, dscores = ops.moe_backward_routed(dout.contiguous(), x, w1, w2, saved, ctx.top_k, w3)
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dw1, dw2, None, dscores, dw3


torch.library.register_autograd("smoe::moe_forward_routed", _backward_routed, setup_context=_setup_context_routed)


def nonfinite_status(device=None):
    """(flags, nonfinite_tokens, first_token) of the sticky device status. Reading it syncs."""
    like = torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device()))
    raw = _C.nonfinite_status(like).cpu()
    flags = int(raw[0:4].view(torch.int32).item()) & 0xFFFFFFFF
    count = int(raw[4:8].view(torch.int32).item()) & 0xFFFFFFFF
    first = int(raw[8:16].view(torch.int64).item())
    return flags, count, first


_FLAG_NAMES = {1: "non-finite router logits", 2: "expert id outside [-1, E)", 4: "expert listed twice in a token",
               8: "non-finite routing scores"}


def reset_nonfinite_status(device=None):
    """Clear the sticky device status (flags, count, first token)."""
    _C.reset_nonfinite_status(torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device())))


def raise_if_nonfinite(device=None, reset=True):
    """Raise FloatingPointError if any forward since the last reset saw NaN/Inf router logits (or, with
    provided routing, a bad id or score), naming the first token. One device sync: call it once per
    step, or every N steps. reset=True clears the record after reading it."""
    flags, count, first = nonfinite_status(device)
    if reset:
        reset_nonfinite_status(device)
    if flags:
        what = ", ".join(v for k, v in _FLAG_NAMES.items() if flags & k)
        where = f"; {count} token(s) with non-finite logits, the first is token {first}" if flags & 1 else ""
        raise FloatingPointError(f"smoe: {what}{where}")


def init(device=None):
    """Create this thread's library handle for `device` (smoe::moe_init). Call it once before capturing
    the layer in a CUDA graph; outside capture the first call does it anyway."""
    _C.init(torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device())))
