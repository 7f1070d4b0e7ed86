"""Expert parallelism over the GPUs of one node: smoe's NCCL device-API dispatch / combine around the
local experts (smoe/ep.h), as torch ops with autograd.

    group = smoe_torch.ep.EpGroup(max_tokens=T, d=d, n=n, num_experts=E, top_k=K)  # collective
    out = smoe_torch.ep.ep_moe(group, x, expert, scores, w1_local, w2_local)
      x [T, d] bf16 (this rank's tokens), expert [T, K] int32 global ids (-1 = empty slot),
      scores [T, K] fp32 (from any router: autograd flows to it), w1_local [E/R, 2n, d] interleaved
      gate/up, w2_local [E/R, d, n]: this rank's experts (global expert e is rank e // (E/R)'s
      local expert e % (E/R)).

The context owns an NCCL communicator of its own, bootstrapped from a torch.distributed group
(unique id broadcast); NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set if unset). Every
rank calls ep_moe (and its backward) in the same order: they are collective.
"""
import os

import torch
import torch.distributed as dist

from . import _C  # noqa: F401  (torch.ops.smoe, defined first)

try:
    from . import _ep
except ImportError as _e:  # built without NCCL
    _ep = None
    _ep_import_error = _e


class EpGroup:
    def __init__(self, max_tokens, d, n, num_experts, top_k, group=None, comm_blocks=32, recv_capacity=0,
                 barrier_timeout_ms=0):
        """recv_capacity: received tokens a rank holds (0: world * max_tokens, nothing dropped; smaller
        drops the tokens past it deterministically and flags it, see smoe/ep.h).
        barrier_timeout_ms: > 0 bounds every wait for a peer (a timed-out call's results are invalid)."""
        if _ep is None:
            raise RuntimeError(f"smoe_torch was built without expert parallelism: {_ep_import_error}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts = {num_experts} must be a multiple of the EP world size {self.world}")
        uid = [_ep.unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        dev = torch.cuda.current_device()
        self.handle = _ep.create(uid[0], self.rank, self.world, dev, max_tokens, d, n, num_experts, top_k, comm_blocks,
                                 recv_capacity, barrier_timeout_ms)
        self.max_tokens, self.d, self.n, self.E, self.K = max_tokens, d, n, num_experts, top_k
        self.experts_per_rank = num_experts // self.world
        self.info = dict(_ep.info(self.handle))
        _ep_shapes[self.handle] = (self.n, self.K, self.world, self.info["experts_per_rank"],
                                   self.info["local_slots"], self.info["recv_capacity"])

    def close(self):
        """Collective: every rank closes its group."""
        if self.handle:
            h, self.handle = self.handle, 0
            _ep_shapes.pop(h, None)
            _ep.destroy(h)

    def status_flags(self):
        """The DeviceStatus flags of this group's calls (syncs): smoe/ep.h's kStatusEp* and smoe.h's."""
        return int(_ep.status(self.handle)[:4].view(torch.int32).item()) & 0xffffffff

    def saved_state_bytes(self, T):
        return _ep.saved_state_size(self.handle, T)


_ep_shapes = {}   # handle -> (n, K, world, experts per rank, local slots, receive capacity)


def _align(b):
    return (b + 255) // 256 * 256


def ep_saved_state_bytes(handle, T):
    """ep_saved_state_size in Python (src/ep/ep_layer.cpp's saved layout: the local layer's saved state
    over the receive capacity, then the counts, send_pos and ids), symbolic in T for torch.compile.
    Tested against the C++ query (tests/python/test_ep.py)."""
    from . import saved_state_bytes
    n, K, R, El, Kl, cap = _ep_shapes[handle]
    return saved_state_bytes(cap, n, El, Kl, router=2) + _align(R * R * 4) + _align(R * T * 4) + _align(T * K * 4)


if _ep is not None:
    @torch.library.register_fake("smoe::ep_forward")
    def _ep_forward_fake(ctx, x, expert, scores, w1, w2):
        return torch.empty_like(x), x.new_empty((ep_saved_state_bytes(ctx, x.shape[0]),), dtype=torch.uint8)

    @torch.library.register_fake("smoe::ep_backward")
    def _ep_backward_fake(ctx, dout, x, w1, w2, saved):
        return (torch.empty_like(x), x.new_empty((x.shape[0], _ep_shapes[ctx][1]), dtype=torch.float32),
                torch.empty_like(w1), torch.empty_like(w2))

    def _setup(ctx, inputs, output):
        handle, x, _expert, _scores, w1, w2 = inputs
        ctx.handle = handle
        ctx.save_for_backward(x, w1, w2, output[1])

    def _backward(ctx, dout, _dsaved):
        x, w1, w2, saved = ctx.saved_tensors
        dx, dscores, dw1, dw2 = torch.ops.smoe.ep_backward(ctx.handle, dout.contiguous(), x, w1, w2, saved)
        return None, dx, None, dscores, dw1, dw2

    torch.library.register_autograd("smoe::ep_forward", _backward, setup_context=_setup)


def ep_moe(group, x, expert, scores, w1_local, w2_local):
    """This rank's tokens through the expert-parallel layer (see the module docstring)."""
    out, _saved = torch.ops.smoe.ep_forward(group.handle, x, expert.to(torch.int32).contiguous(),
                                            scores.to(torch.float32).contiguous(), w1_local, w2_local)
    return out
