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
The ops' fakes and autograd are registered in _ops.py (load_ep), their sizes computed in _layout.py.
"""
import os

import torch
import torch.distributed as dist

from . import _C, _layout, _ops  # _C (torch.ops.smoe) is loaded before _ep's fragment adds to it
from ._layout import ep_saved_state_bytes  # noqa: F401  (the fakes' saved size, symbolic in T)

# smoe_torch._ep with its ops' fakes and autograd registered (_ops.load_ep), or None: built without NCCL.
_ep, _ep_import_error = _ops.load_ep()


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
        # The group's global ranks in group order (MoE(ep_mesh=) checks its mesh against them).
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
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
        # The local layer's saved state does not depend on T: asked of C++ once (moe_saved_state_size
        # of the context's local_shape: T = receive capacity, E / R experts, min(K, E / R) slots).
        layer_bytes = _C.saved_state_size(self.info["recv_capacity"], d, n, self.info["experts_per_rank"],
                                          self.info["local_slots"], _layout.ROUTER_PROVIDED, 0)
        _layout.register_ep_group(self.handle, layer_bytes, self.world, self.K)

    def close(self):
        """Collective: every rank closes its group."""
        if self.handle:
            h, self.handle = self.handle, 0
            _layout.forget_ep_group(h)
            _ep.destroy(h)

    def status_flags(self):
        """The DeviceStatus flags of this group's calls (syncs): smoe/ep.h's kStatusEp* and smoe.h's."""
        return int(_ep.status(self.handle)[:4].view(torch.int32).item()) & 0xffffffff

    def saved_state_bytes(self, T):
        return _ep.saved_state_size(self.handle, T)


def ep_moe(group, x, expert, scores, w1_local, w2_local):
    """This rank's tokens through the expert-parallel layer (see the module docstring)."""
    out, _saved = torch.ops.smoe.ep_forward(group.handle, x, expert.to(torch.int32).contiguous(),
                                            scores.to(torch.float32).contiguous(), w1_local, w2_local)
    return out
