"""Expert parallelism over torch.distributed all-to-all (any backend: NCCL across nodes, gloo on the CPU).

torchtitan's all-to-all pattern, feeding smoe's expert-major layer:

    out = smoe_torch.ep_a2a.moe_ep_a2a(x, topk_idx, topk_scores, w1, w3, w2, group)
      x [T, d] (this rank's tokens), topk_idx [T, K] global expert ids in [0, E) (-1 = empty slot),
      topk_scores [T, K] (any float dtype; autograd flows to it), w1 / w3 [E/P, n, d] gate / up and
      w2 [E/P, d, n]: this rank's experts (global expert e is rank e // (E/P)'s local expert e % (E/P)).
      w3=None: w1 holds gate and up in one tensor, laid out as `gate_up` says (the layer's default
      then: "concatenated").
      out [T, d] in x's dtype, differentiable to x, topk_scores and the local weights.

Every rank of the group calls it (and its backward) in the same order: the hops are collective.

The hops, each a public function so a benchmark can put CUDA events between them (no timing code
or hooks in the hot path; `moe_ep_a2a` is exactly their composition):
  1. layout(topk_idx, E_local, group): stable argsort of the (token, k) entries by global expert,
     counts per expert, all_to_all_single of the counts, and the one device-to-host sync of this
     pattern: the split sizes (rows to / from every rank), which all_to_all_single needs on the host.
     torchtitan has the same sync (its output splits are copied with non_blocking=False). The id
     check rides on the same copy. Returns an A2APlan; nothing else in the forward or backward syncs.
  2. dispatch(x, topk_scores, plan): rows gathered into send order (one row per entry, expert-major
     over global experts, so each destination's rows are contiguous), all_to_all_single of the rows
     and of the entries' fp32 scores.
  3. to_expert_major(rows, probs, plan): the received rows arrive grouped by (source rank, local
     expert); one gather permutes them to (local expert, source rank), as torchtitan's _permute.
  4. the expert-major layer: experts_fn(rows, counts [E/P] int32 on the device, w1, w2, w3,
     probs=probs, gate_up=...). probs are applied inside it (before the down projection), so what
     comes back is already score-weighted and the combine is a plain sum.
  5. from_expert_major(y, plan): the inverse gather, back to (source rank, local expert).
  6. combine(y, plan): all_to_all_single back to the sources, then the rows are put back to their
     (t, k) places by a gather into [T, K, d] and summed over K in k order in fp32.

Determinism: every sort is stable, every permutation is a gather (forward and backward: custom
autograd functions, so no backward goes through index_put / index_add), every sum has a fixed
order (over k, in fp32) and there are no float atomics, so with a deterministic experts function
the results are bitwise repeatable run to run. Each expert sees the same rows in the same order
as one process holding all ranks' tokens (ascending source rank, then token), so the result equals
that process's up to the experts function's own rounding (the CPU test: 0 to 1e-16 in float64).
Memory and bytes: one row per (token, k) entry goes out and comes back (torchtitan's volume; the
one-node smoe_torch.ep sends a token once per rank), and combine holds a transient [T, K, d].
A2APlan.counts is this rank's tokens per global expert (for load-balancing statistics).

experts_fn defaults to smoe_torch.expert_major for CUDA tensors and to its pure-torch twin
smoe_torch.expert_major_ref otherwise. This module imports nothing of smoe_torch at import time.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["A2APlan", "layout", "dispatch", "to_expert_major", "run_experts", "from_expert_major", "combine",
           "moe_ep_a2a", "A2AExpertParallel", "clip_grad_norm_", "default_experts_fn"]


def _sibling(name):
    """python/smoe_torch/<name>.py (one that imports only torch): from the package, or by its path when
    this file was loaded on its own (CPU tests without the built extension)."""
    import importlib  # noqa: PLC0415
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    import importlib.util  # noqa: PLC0415
    import os  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location(f"_smoe_{name}_file", os.path.join(os.path.dirname(__file__),
                                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def default_experts_fn(x):
    """smoe_torch.expert_major on CUDA, the pure-torch twin smoe_torch.expert_major_ref elsewhere."""
    import smoe_torch  # noqa: PLC0415  (on demand: loads the extension)
    return smoe_torch.expert_major if x.is_cuda else smoe_torch.expert_major_ref


# ---- autograd pieces: gathers both ways, and the all-to-all ---------------------------------------

def _pad_row(t, index):
    """t with one zero row appended when index (a gather index into t) can point past t's rows (the
    target of entries that have no row); t itself when it cannot (no empty slot: no copy). Both sizes
    are host ints: no sync."""
    if index.numel() <= t.shape[0]:
        return t
    return torch.cat((t, t.new_zeros((1, *t.shape[1:]))))


def _sum_groups(t, group):
    """[M * group, ...] -> [M, ...]: the sum over each group of `group` consecutive rows, in order, in
    fp32 (or finer) and back to t's dtype. No atomics."""
    if group == 1:
        return t
    acc = torch.promote_types(t.dtype, torch.float32)
    return t.view(-1, group, *t.shape[1:]).sum(1, dtype=acc).to(t.dtype)


class _Gather(torch.autograd.Function):
    """out[j] = src[index[j]], where every src row i is read by the entries i*group .. i*group+group-1 of
    back_index: back_index[i*group + g] = the j that reads it, or len(index) for none. Backward is a
    gather too: dsrc[i] = sum_g dout[back_index[i*group + g]] (zero for none), summed in g order."""

    @staticmethod
    def forward(ctx, src, index, back_index, group):
        ctx.save_for_backward(back_index)
        ctx.group = group
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, dout):
        (back_index,) = ctx.saved_tensors
        dsrc = _sum_groups(_pad_row(dout.contiguous(), back_index).index_select(0, back_index), ctx.group)
        return dsrc, None, None, None


class _GatherSum(torch.autograd.Function):
    """The adjoint of _Gather: out[i] = sum_g src[back_index[i*group + g]] (zero for len(src)), summed in
    g order in fp32; backward dsrc[j] = dout[index[j]]."""

    @staticmethod
    def forward(ctx, src, back_index, index, group):
        ctx.save_for_backward(index)
        return _sum_groups(_pad_row(src, back_index).index_select(0, back_index), group)

    @staticmethod
    def backward(ctx, dout):
        (index,) = ctx.saved_tensors
        return dout.contiguous().index_select(0, index), None, None, None


class _Permute(torch.autograd.Function):
    """out = src[perm]; backward dsrc = dout[inv] (inv the inverse permutation): gathers only."""

    @staticmethod
    def forward(ctx, src, perm, inv):
        ctx.save_for_backward(inv)
        return src.index_select(0, perm)

    @staticmethod
    def backward(ctx, dout):
        (inv,) = ctx.saved_tensors
        return dout.contiguous().index_select(0, inv), None, None


def _all_to_all(t, out_splits, in_splits, group):
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd (backward: the same with the splits swapped). Synchronous with
    the caller's stream, as dist.all_to_all_single is."""

    @staticmethod
    def forward(ctx, t, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(t, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dout):
        out_splits, in_splits = ctx.splits
        return _all_to_all(dout, in_splits, out_splits, ctx.group), None, None, None


# ---- the plan (hop 1) --------------------------------------------------------------------------------

@dataclass
class A2APlan:
    """The layout of one call, a pure function of the routing (built by layout()).

    Send side (this rank's T*K entries, entry e = t*K + k):
      send_order   [n_send] int64  the entries in send order (stable sort by global expert; -1 last, not sent)
      send_token   [n_send] int64  send_order // K: the token of each sent row
      entry_slot   [T*K]    int64  position of each entry in send order, n_send for an empty slot
      counts       [E]      int64  this rank's entries per global expert (tokens_per_expert)
    Receive side:
      recv_counts  [P, E_local] int64  rows from rank s for local expert l
      local_counts [E_local] int32     rows per local expert after the regroup (the layer's counts)
      perm / inv   [n_recv] int64      received (rank-major) -> expert-major gather, and its inverse
    Host ints: send_splits / recv_splits [P] (rows to / from each rank), n_send, n_recv."""
    group: object
    world: int
    num_tokens: int
    top_k: int
    num_experts: int
    experts_per_rank: int
    send_order: torch.Tensor
    send_token: torch.Tensor
    entry_slot: torch.Tensor
    counts: torch.Tensor
    recv_counts: torch.Tensor
    local_counts: torch.Tensor
    perm: torch.Tensor
    inv: torch.Tensor
    send_splits: list
    recv_splits: list

    @property
    def n_send(self):
        return sum(self.send_splits)

    @property
    def n_recv(self):
        return sum(self.recv_splits)


def _block_gather(lens_out, starts_out, starts_in, total, device):
    """For blocks laid out in the output order with lengths lens_out, starting at starts_out there and at
    starts_in in the input: index[p] = starts_in[b] + (p - starts_out[b]) for p in block b."""
    nb = lens_out.numel()
    b = torch.repeat_interleave(torch.arange(nb, device=device), lens_out, output_size=total)
    return starts_in[b] + torch.arange(total, device=device) - starts_out[b]


def _exclusive_cumsum(t):
    return t.cumsum(0) - t


def layout(topk_idx, experts_per_rank, group=None):
    """Hop 1: sort, counts, the count all-to-all and the one host sync (see the module docstring)."""
    world = dist.get_world_size(group)
    T, K = topk_idx.shape
    El = experts_per_rank
    E = El * world
    dev = topk_idx.device
    idx = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(idx < 0, torch.full_like(idx, E), idx)            # empty slots sort last
    order = torch.argsort(key, stable=True)                              # entry order within an expert
    counts = torch.bincount(key, minlength=E + 1)[:E]                    # integer counts: deterministic
    # The count exchange: to every rank q its El counts plus this rank's number of bad ids, so a bad id
    # on any rank is an error on every rank (never a hang in the row all-to-all).
    bad = ((idx < -1) | (idx >= E)).sum().view(1, 1).expand(world, 1)
    send = torch.cat((counts.view(world, El), bad), 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                      # row s: from rank s, my experts
    rc = recv[:, :El].contiguous()
    # The host sync: rows to send to / receive from every rank, and the id check, in one copy.
    host = torch.cat((counts.view(world, El).sum(1), rc.sum(1), recv[:, El].sum().view(1))).cpu().tolist()
    send_splits, recv_splits, n_bad = host[:world], host[world:2 * world], host[2 * world]
    if n_bad:
        raise ValueError(f"topk_idx has {n_bad} ids outside [-1, {E}) over the group's ranks "
                         f"(E = {El} local experts x {world} ranks)")
    n_send, n_recv = sum(send_splits), sum(recv_splits)
    send_order = order[:n_send]
    pos = torch.argsort(order)                                           # inverse permutation (no scatter)
    entry_slot = torch.where(pos < n_send, pos, torch.full_like(pos, n_send))
    # Regroup: block (s, l) of rc starts at src_off[s, l] received (rank-major) and at dst_off[s, l]
    # expert-major ((l, s) order).
    src_off = _exclusive_cumsum(rc.reshape(-1)).view(world, El)
    dst_off = _exclusive_cumsum(rc.t().reshape(-1)).view(El, world).t()
    perm = _block_gather(rc.t().reshape(-1), dst_off.t().reshape(-1), src_off.t().reshape(-1), n_recv, dev)
    inv = _block_gather(rc.reshape(-1), src_off.reshape(-1), dst_off.reshape(-1), n_recv, dev)
    return A2APlan(group=group, world=world, num_tokens=T, top_k=K, num_experts=E, experts_per_rank=El,
                   send_order=send_order, send_token=torch.div(send_order, K, rounding_mode="floor"),
                   entry_slot=entry_slot, counts=counts, recv_counts=rc, local_counts=rc.sum(0).to(torch.int32),
                   perm=perm, inv=inv, send_splits=send_splits, recv_splits=recv_splits)


# ---- hops 2-6 ----------------------------------------------------------------------------------------

def dispatch(x, topk_scores, plan):
    """Hop 2: rows and scores (fp32) in send order, then all-to-all. Returns (rows, probs) as received:
    grouped by (source rank, local expert)."""
    if x.shape[0] != plan.num_tokens or tuple(topk_scores.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"x {tuple(x.shape)} / topk_scores {tuple(topk_scores.shape)} do not match the plan's "
                         f"T = {plan.num_tokens}, K = {plan.top_k}")
    rows = _Gather.apply(x, plan.send_token, plan.entry_slot, plan.top_k)
    # fp32 probs (the layer's contract; float64 scores stay float64, for the twin's checks)
    pdt = torch.promote_types(topk_scores.dtype, torch.float32)
    probs = _Gather.apply(topk_scores.reshape(-1).to(pdt), plan.send_order, plan.entry_slot, 1)
    rows = _AllToAll.apply(rows, plan.recv_splits, plan.send_splits, plan.group)
    probs = _AllToAll.apply(probs, plan.recv_splits, plan.send_splits, plan.group)
    return rows, probs


def to_expert_major(rows, probs, plan):
    """Hop 3: (source rank, local expert) -> (local expert, source rank), rows and probs."""
    return _Permute.apply(rows, plan.perm, plan.inv), _Permute.apply(probs, plan.perm, plan.inv)


def run_experts(rows, probs, w1, w3, w2, plan, experts_fn=None, gate_up=None):
    """Hop 4: the expert-major layer on this rank's experts, probs applied inside."""
    fn = experts_fn if experts_fn is not None else default_experts_fn(rows)
    if gate_up is None and w3 is not None:
        gate_up = "separate"
    kwargs = {"probs": probs}
    if gate_up is not None:
        kwargs["gate_up"] = gate_up
    return fn(rows, plan.local_counts, w1, w2, w3, **kwargs)


def from_expert_major(y, plan):
    """Hop 5: the inverse of to_expert_major."""
    return _Permute.apply(y, plan.inv, plan.perm)


def combine(y, plan):
    """Hop 6: all-to-all back, then out[t] = sum over k of the entry's row (zero for an empty slot), in k
    order, fp32 accumulation, x's dtype."""
    back = _AllToAll.apply(y, plan.send_splits, plan.recv_splits, plan.group)
    return _GatherSum.apply(back, plan.entry_slot, plan.send_token, plan.top_k)


def moe_ep_a2a(x, topk_idx, topk_scores, w1, w3, w2, group=None, *, experts_fn=None, gate_up=None):
    """This rank's tokens through the all-to-all expert-parallel layer (see the module docstring)."""
    plan = layout(topk_idx, w1.shape[0], group)
    rows, probs = to_expert_major(*dispatch(x, topk_scores, plan), plan)
    y = run_experts(rows, probs, w1, w3, w2, plan, experts_fn, gate_up)
    return combine(from_expert_major(y, plan), plan)


class A2AExpertParallel(torch.nn.Module):
    """The local experts of an all-to-all EP group as a module (torchtitan's GroupedExperts layout:
    w1 / w3 gate / up [E/P, n, d], w2 [E/P, d, n]); forward(x, topk_idx, topk_scores) -> [T, d].
    The router is the caller's. Expert gradients are local: never average them over the EP group.

    mesh (a 1-D DeviceMesh over the EP group; the group is then mesh.get_group()): the three weights
    become DTensors of global shape [E, n, d] / [E, d, n], Shard(0) on the mesh (the local shard is
    this rank's E/P experts, as without a mesh). Without one, every rank's plain Parameters carry the
    same names and shapes, so DCP saves one rank's experts as all of them ([E/P, ...]) and
    clip_grad_norm_ sees only this rank's experts; with it, DCP saves [E, ...] in shards and a DTensor
    norm covers all experts. Mixed with plain (replicated) parameters, use this module's
    clip_grad_norm_ (torch's raises on mixed Tensor and DTensor grads)."""

    def __init__(self, d, n, num_experts, group=None, experts_fn=None, device=None, dtype=None, mesh=None):
        super().__init__()
        if mesh is not None:
            if mesh.ndim != 1:
                raise ValueError(f"mesh must be 1-D (the EP group), got {mesh.ndim} dims")
            if group is not None and group is not mesh.get_group():
                raise ValueError("pass either group or mesh (mesh.get_group() is the EP group)")
            group = mesh.get_group()
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts = {num_experts} must be a multiple of the EP group size {world}")
        El = num_experts // world
        f = dict(device=device, dtype=dtype)

        def param(*shape):
            t = torch.empty(El, *shape, **f)
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415
                # Even shards, so from_local infers the global shape [E, ...]; run_check=False: no
                # collective (its default differs between torch versions).
                t = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
            return torch.nn.Parameter(t)

        self.w1, self.w3, self.w2 = param(n, d), param(n, d), param(d, n)
        self.group, self.experts_fn, self.num_experts, self.mesh = group, experts_fn, num_experts, mesh
        self.reset_parameters()

    def _local(self, w):
        # to_local is differentiable: its backward wraps the local gradient back into a Shard(0) DTensor.
        return w.to_local() if self.mesh is not None else w

    def reset_parameters(self, std=0.02):
        # The local shard itself (a DTensor init op would draw from DTensor's own RNG offsets), expert by
        # global index (packing.init_experts_; this rank holds [rank * E/P, (rank + 1) * E/P)): the plain
        # and mesh modules agree, ranks differ, and the experts equal a one-process module's (P = 1).
        first = dist.get_rank(self.group) * (self.num_experts // dist.get_world_size(self.group))
        _sibling("packing").init_experts_([self._local(w) for w in (self.w1, self.w2, self.w3)], std, first)

    def forward(self, x, topk_idx, topk_scores):
        w1, w3, w2 = (self._local(w) for w in (self.w1, self.w3, self.w2))
        return moe_ep_a2a(x, topk_idx, topk_scores, w1, w3, w2, self.group, experts_fn=self.experts_fn)


def _mesh_key(t):
    from torch.distributed.tensor import DTensor  # noqa: PLC0415
    return id(t.device_mesh) if isinstance(t, DTensor) else None


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """torch.nn.utils.clip_grad_norm_ for a mix of plain (replicated) and DTensor (e.g. the EP experts')
    gradients, which torch's rejects ('mixed torch.Tensor and DTensor', torch 2.11 and 2.15 alike).
    The grads are grouped by mesh (plain ones as one group); each group's norm is a plain tensor (a
    DTensor group's is reduced over its mesh by full_tensor, so every rank gets the same value), the
    groups' norms combine as torch's do, and every grad is scaled by min(1, max_norm / (norm + 1e-6)).
    No foreach: the same per-tensor norms in the same order on every rank. Returns the total norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups = {}
    for g in grads:
        groups.setdefault(_mesh_key(g), []).append(g)
    norms = []
    for key, gs in groups.items():
        n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in gs]), norm_type)
        norms.append(n.full_tensor() if key is not None else n)
    dev = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        # the local shard in place (under no_grad to_local is the DTensor's own local tensor)
        (g.to_local() if _mesh_key(g) is not None else g).mul_(coef.to(g.device))
    return total
