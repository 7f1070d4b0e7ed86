"""Loads the extension and registers what torch needs around its ops.

Importing this module (smoe_torch does) loads smoe_torch._C, whose TORCH_LIBRARY(smoe) defines the
schemas and CUDA kernels of torch.ops.smoe.* (csrc/ops.cpp), then registers for each op a fake (meta)
implementation, so that torch.compile(fullgraph=True) traces through them, and autograd for the three
forward ops (backward = the matching backward op), and defines two small Python ops of MoE.forward
(saved_expert_frequency, count_tokens_once) that torch.compile could not trace as plain calls. The
expert-parallel ops (smoe_torch._ep, csrc/ep_ops.cpp, built only with NCCL) are loaded and
registered by load_ep(), which smoe_torch.ep calls when it is imported. Buffer sizes come from
_layout.py.
"""
import os

import torch

from . import _C  # noqa: F401  (registers torch.ops.smoe.*)
from . import _layout

ops = torch.ops.smoe


def _saved_fake(x, E, n, K, router=_layout.ROUTER_TOPK_SOFTMAX, rounding=0):
    T = x.shape[0]
    return x.new_empty((_layout.saved_state_bytes(T, n, E, K, router, rounding),), dtype=torch.uint8)


def _dw1_fake(w1, w3):
    """The backward's first-projection gradient: like w1, or [2, E, n, d] (dw1, dw3) with w3."""
    return torch.empty_like(w1) if w3 is None else w1.new_empty((2, *w1.shape))


@torch.library.register_fake("smoe::moe_forward")
def _moe_forward_fake(x, w_router, w1, w2, top_k, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k)


@torch.library.register_fake("smoe::moe_forward_tr")
def _moe_forward_tr_fake(x, w_router, w1, w2, top_k, rounding, seed, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], top_k, _layout.ROUTER_TOKEN_ROUNDING,
                                            rounding)


@torch.library.register_fake("smoe::moe_forward_routed")
def _moe_forward_routed_fake(x, w1, w2, expert, scores, w3=None):
    return torch.empty_like(x), _saved_fake(x, w1.shape[0], w2.shape[2], expert.shape[1], _layout.ROUTER_PROVIDED)


@torch.library.register_fake("smoe::moe_backward_routed")
def _moe_backward_routed_fake(dout, x, w1, w2, saved, top_k, w3=None, consume_saved=False):
    return (torch.empty_like(x), _dw1_fake(w1, w3), torch.empty_like(w2),
            x.new_empty((x.shape[0], top_k), dtype=torch.float32))


@torch.library.register_fake("smoe::moe_backward_tr")
def _moe_backward_tr_fake(dout, x, w_router, w1, w2, saved, top_k, rounding, w3=None, consume_saved=False):
    return torch.empty_like(x), torch.empty_like(w_router), _dw1_fake(w1, w3), torch.empty_like(w2)


@torch.library.register_fake("smoe::moe_backward")
def _moe_backward_fake(dout, x, w_router, w1, w2, saved, top_k, w3=None, consume_saved=False):
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


def _saved_takes_no_grad(ctx, saved):
    """The saved state (uint8) carries no gradient, and the backward gets None for it, not zeros.

    By default the autograd engine materializes a zero tensor for every output without a gradient and
    passes it to backward: here one as large as the saved state (4TKn bytes: 1.6 GB at Qwen3-235B),
    allocated and filled on every backward. On the H100 that fill took 0.16-0.52 ms of a 13-48 ms step on
    the large public configs (bench/results/h100/sonic_profile.md) and raised the backward's peak by the
    saved state's size. So grads are not materialized; the output's gradient is then None only where no
    gradient reached it, which _dout handles."""
    ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)


def _dout(dout, like):
    """The output's gradient, contiguous; zeros where the engine passed None (no gradient reached the
    output, possible once grads are not materialized)."""
    return torch.zeros_like(like) if dout is None else dout.contiguous()


def _consume_saved(saved, dout=None):
    """Whether this backward may write dH over the saved H (consume_saved: H's bytes, 4TKn, less at the
    backward's peak, what SonicMoE's per-GEMM autograd nodes get by freeing H after its dH kernel).

    Only where nothing can read the saved state again: an eager backward (a plain tensor, no dispatch
    mode, not compiling: a traced graph must never carry the flag into a later replay) run by the
    autograd engine without keep_graph (retain_graph false; create_graph sets it unless told otherwise), which frees the saved
    tensors as the node returns. Not under a functorch transform either: batched gradients
    (autograd.grad(is_grads_batched=True), jacobian(vectorize=True)) run the op once per batch slice
    on the one saved state. Not while a CUDA graph is captured (its backward may be replayed more
    often than its forward). SMOE_CONSUME_SAVED=0 (read at import) turns it off. Were the state read again anyway,
    the library finds its stamp cleared: NaN gradients and the bad-saved-state status, never the
    gradients of an overwritten H."""
    if torch.compiler.is_compiling() or _CONSUME_OFF or type(saved) is not torch.Tensor:
        return False
    if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    if dout is not None and (torch._C._functorch.is_batchedtensor(dout)
                             or torch._C._functorch.is_legacy_batchedtensor(dout)):
        return False  # autograd.grad(is_grads_batched=True): the legacy vmap, no transform level
    if saved.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    if torch._C._current_graph_task_id() == -1:  # called directly, not by the autograd engine
        return False
    return not torch._C._autograd._get_current_graph_task_keep_graph()


_CONSUME_OFF = os.environ.get("SMOE_CONSUME_SAVED", "1") == "0"


def _setup_context(ctx, inputs, output):
    x, w_router, w1, w2, top_k, w3 = inputs
    _, saved = output
    ctx.save_for_backward(x, w_router, w1, w2, saved, w3)
    ctx.top_k = top_k
    _saved_takes_no_grad(ctx, saved)


def _backward(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward(_dout(dout, x), x, w_router, w1, w2, saved, ctx.top_k, w3,
                                         _consume_saved(saved, dout))
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dwr, dw1, dw2, None, dw3


torch.library.register_autograd("smoe::moe_forward", _backward, setup_context=_setup_context)


def _setup_context_tr(ctx, inputs, output):
    x, w_router, w1, w2, top_k, rounding, _seed, w3 = inputs
    ctx.save_for_backward(x, w_router, w1, w2, output[1], w3)
    ctx.top_k, ctx.rounding = top_k, rounding
    _saved_takes_no_grad(ctx, output[1])


def _backward_tr(ctx, dout, _dsaved):
    x, w_router, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dwr, dw1, dw2 = ops.moe_backward_tr(_dout(dout, x), x, w_router, w1, w2, saved, ctx.top_k, ctx.rounding, w3,
                                            _consume_saved(saved, dout))
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dwr, dw1, dw2, None, None, None, dw3


torch.library.register_autograd("smoe::moe_forward_tr", _backward_tr, setup_context=_setup_context_tr)


def _setup_context_routed(ctx, inputs, output):
    x, w1, w2, expert, _scores, w3 = inputs
    ctx.save_for_backward(x, w1, w2, output[1], w3)
    ctx.top_k = expert.shape[1]
    _saved_takes_no_grad(ctx, output[1])


def _backward_routed(ctx, dout, _dsaved):
    x, w1, w2, saved, w3 = ctx.saved_tensors
    dx, dw1, dw2, dscores = ops.moe_backward_routed(_dout(dout, x), x, w1, w2, saved, ctx.top_k, w3,
                                                    _consume_saved(saved, dout))
    dw1, dw3 = _split_dw1(dw1, w3)
    return dx, dw1, dw2, None, dscores, dw3


torch.library.register_autograd("smoe::moe_forward_routed", _backward_routed, setup_context=_setup_context_routed)


# Two small ops of MoE.forward, defined here in Python so that torch.compile(fullgraph=True) traces
# through them (dynamo skips pybind functions and refuses the autograd-engine query below) while eager
# computes exactly what it did before.

@torch.library.custom_op("smoe::saved_expert_frequency", mutates_args=())
def saved_expert_frequency(saved: torch.Tensor, T: int, d: int, n: int, E: int, K: int, router: int,
                           rounding: int) -> torch.Tensor:
    """The rows each expert received in a forward (int32 [E]), read from its saved state by
    _C.saved_expert_frequency (csrc/ops.cpp); a copy, since a custom op may not return a view of its
    input (4E bytes)."""
    return _C.saved_expert_frequency(saved, T, d, n, E, K, router, rounding).clone()


@saved_expert_frequency.register_fake
def _saved_expert_frequency_fake(saved, T, d, n, E, K, router, rounding):
    return saved.new_empty((E,), dtype=torch.int32)


def in_backward():
    """True while the autograd engine runs a backward (where activation checkpointing recomputes)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@torch.library.custom_op("smoe::count_tokens_once", mutates_args=("tokens_per_expert",))
def count_tokens_once(tokens_per_expert: torch.Tensor, counts: torch.Tensor) -> None:
    """tokens_per_expert += counts, except while a backward runs: an activation checkpoint's recompute
    runs the forward again inside backward, and its tokens were counted by the forward. The check is
    made when the op runs, so a compiled module recomputed by an eager checkpoint skips it too."""
    if not in_backward():
        tokens_per_expert.add_(counts)


@count_tokens_once.register_fake
def _count_tokens_once_fake(tokens_per_expert, counts):
    return None


# Expert parallelism: smoe::ep_forward / smoe::ep_backward take the EP context as an int handle;
# their fakes read its sizes from _layout's registry (EpGroup fills it).

def _ep_forward_fake(ctx, x, expert, scores, w1, w2):
    return torch.empty_like(x), x.new_empty((_layout.ep_saved_state_bytes(ctx, x.shape[0]),), dtype=torch.uint8)


def _ep_backward_fake(ctx, dout, x, w1, w2, saved):
    return (torch.empty_like(x), x.new_empty((x.shape[0], _layout.ep_top_k(ctx)), dtype=torch.float32),
            torch.empty_like(w1), torch.empty_like(w2))


def _ep_setup_context(ctx, inputs, output):
    handle, x, _expert, _scores, w1, w2 = inputs
    ctx.handle = handle
    ctx.save_for_backward(x, w1, w2, output[1])
    _saved_takes_no_grad(ctx, output[1])


def _ep_backward(ctx, dout, _dsaved):
    x, w1, w2, saved = ctx.saved_tensors
    dx, dscores, dw1, dw2 = ops.ep_backward(ctx.handle, _dout(dout, x), x, w1, w2, saved)
    return None, dx, None, dscores, dw1, dw2


_ep_state = None  # (module or None, ImportError or None) once load_ep() has run


def load_ep():
    """(smoe_torch._ep, None) with the EP ops' fakes and autograd registered, or (None, the ImportError)
    when the package was built without NCCL. The first call imports and registers; later calls return
    the same pair."""
    global _ep_state
    if _ep_state is None:
        try:
            from . import _ep  # after _C: its TORCH_LIBRARY_FRAGMENT(smoe) adds ep_forward / ep_backward
        except ImportError as e:  # built without NCCL
            _ep_state = (None, e)
        else:
            torch.library.register_fake("smoe::ep_forward")(_ep_forward_fake)
            torch.library.register_fake("smoe::ep_backward")(_ep_backward_fake)
            torch.library.register_autograd("smoe::ep_forward", _ep_backward, setup_context=_ep_setup_context)
            _ep_state = (_ep, None)
    return _ep_state
