"""The gate/up pair of SwiGLU experts in one interleaved storage, so that the kernels' w1 operand
is a view, not a per-step copy.

The kernels take the first projection as one [..., 2h, d] tensor with gate and up rows interleaved
(row 2j = gate row j, row 2j + 1 = up row j: the SwiGLU pair lands in one thread's accumulators).
torchtitan stores the two as separate parameters w1 (gate) and w3 (up), each [..., h, d]. The
modules here keep those names, shapes and state-dict keys, but allocate both parameters as views
of one [..., h, 2, d] storage (`pack_pair_`). `interleaved_pair(w1, w3)` then returns the
[..., 2h, d] kernel operand over that same memory, with no copy, and its backward hands each
parameter its strided half of the kernel's gradient (which autograd's AccumulateGrad copies once:
it keeps a gradient of a non-dense parameter only if it is contiguous). Whenever the two are not in
that layout (another dtype to cast to, FSDP / DTensor shards, a parameter replaced by hand,
torch.compile tracing), `gate_up_operands` hands the kernels the two tensors as they are (gate/up
as two tensors, no stack); `interleaved_pair` (the EP path) stacks them, with the same values and
gradients.

The layout survives `.to()` / `.cuda()` / `to_empty()` (the modules re-pack in `_apply`),
`load_state_dict` (in-place copies keep it; `assign=True` is re-packed by a post hook) and
`copy.deepcopy` / pickling (re-packed in `__setstate__`).

Packing is OPT-IN (`pack_gate_up=True`): packed halves are strided, not dense, and torch's fused
optimizers refuse them (CUDA `AdamW(fused=True)`, torchtitan's default: "params, grads, exp_avgs, and
exp_avg_sqs must have same dtype, device, and layout", measured on the H200 at 29ae5a4; the CPU fused
kernel silently updates the wrong elements). It pays only for bf16 parameters (no per-step copy of
w1 / w3; an fp32 pair is cast anyway, and goes to the kernels as two tensors): ~2.5-4% of a layer
step (bench/results/h200/module_vs_op.json). By default the parameters are dense and reach the kernels
as two tensors (gate / up halves, no stack).
No torch extension is imported here: the CPU tests check this module without a GPU.
"""
import torch


def _packed_strides(w):
    """Strides a [..., h, d] half of a contiguous [..., h, 2, d] storage has."""
    d = w.shape[-1]
    strides, acc = [1, 2 * d], 2 * d * w.shape[-2]
    for size in reversed(w.shape[:-2]):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def is_packed_pair(w1, w3):
    """True when w3 is the up half next to w1's gate half in one [..., h, 2, d] storage."""
    if not (type(w1) in (torch.Tensor, torch.nn.Parameter) and type(w3) in (torch.Tensor, torch.nn.Parameter)):
        return False  # DTensor and other subclasses: their local storage is not ours to reinterpret
    if w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device or w1.dim() < 2:
        return False
    if w1.device.type == "meta" or w1.numel() == 0:
        return False
    want = _packed_strides(w1)
    if w1.stride() != want or w3.stride() != want:
        return False
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return False
    return w3.storage_offset() == w1.storage_offset() + w1.shape[-1]


class _InterleavedView(torch.autograd.Function):
    """[..., h, d] x 2 halves of one storage -> the [..., 2h, d] interleaved view over it."""

    @staticmethod
    def forward(ctx, w1, w3):
        h, d = w1.shape[-2:]
        shape = (*w1.shape[:-2], 2 * h, d)
        stride = (*w1.stride()[:-2], d, 1)
        return w1.as_strided(shape, stride, w1.storage_offset())

    @staticmethod
    def backward(ctx, g):
        g = g.unflatten(-2, (g.shape[-2] // 2, 2))  # [..., h, 2, d]: row 2j + i -> (j, i)
        return g[..., 0, :], g[..., 1, :]


def _viewable(w1, w3, dtype):
    """The pair can be read as the interleaved operand in place: packed, already in dtype, eager."""
    return w1.dtype == dtype and not torch.compiler.is_compiling() and is_packed_pair(w1, w3)


def interleaved_pair(w1, w3, dtype):
    """The kernels' [..., 2h, d] operand (gate row j at 2j, up row j at 2j + 1) in `dtype`.

    A view of the parameters' memory when they are packed (`pack_pair_`) and already in `dtype`;
    otherwise a copy, as torch.stack would make it. Gradients flow to w1 and w3 either way."""
    if _viewable(w1, w3, dtype):
        return _InterleavedView.apply(w1, w3)
    return torch.stack((w1.to(dtype), w3.to(dtype)), dim=-2).flatten(-3, -2)


@torch.no_grad()
def pack_pair_(w1, w3):
    """Re-seat the two parameters (same shape, dtype, device) as halves of one new [..., h, 2, d]
    storage, values kept. The Parameter objects stay the same (optimizers keep their references);
    only `.data` moves. Subclasses (DTensor), meta tensors and mismatched pairs are left alone.
    Returns whether the pair is packed afterwards."""
    if is_packed_pair(w1, w3):
        return True
    if not (type(w1) is torch.nn.Parameter and type(w3) is torch.nn.Parameter):
        return False
    if w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device or w1.dim() < 2:
        return False
    if w1.device.type == "meta" or w1.numel() == 0:
        return False
    packed = torch.empty((*w1.shape[:-1], 2, w1.shape[-1]), dtype=w1.dtype, device=w1.device)
    packed[..., 0, :] = w1
    packed[..., 1, :] = w3
    w1.data = packed[..., 0, :]
    w3.data = packed[..., 1, :]
    return True


class PackedGateUp(torch.nn.Module):
    """With `pack_gate_up` True, keeps a module's (gate, up) parameter pair packed in one storage
    (above): after every `.to()` / `.cuda()` / `to_empty()` and every `load_state_dict`. False (the
    default): the parameters stay dense, as any optimizer wants them. Subclasses name the pair."""

    pack_gate_up = False  # a class default, so modules pickled before the flag existed still load

    def _gate_up(self):
        raise NotImplementedError

    def _repack(self):
        return pack_pair_(*self._gate_up()) if self.pack_gate_up else False

    def _apply(self, *args, **kwargs):
        out = super()._apply(*args, **kwargs)  # moves each parameter on its own: re-pack after
        self._repack()
        return out

    def _register_repack_hook(self):
        self.register_load_state_dict_post_hook(self._repack_after_load)  # a method: modules still pickle

    def _repack_after_load(self, module, incompatible_keys):
        self._repack()  # load_state_dict(assign=True) put separate tensors in place

    def __setstate__(self, state):  # copy.deepcopy / pickle copy each parameter on its own
        super().__setstate__(state)
        self._repack()

    def interleaved_w1(self, dtype):
        """The kernels' [E, 2h, d] first projection (gate/up rows interleaved): a view when packed."""
        w1, w3 = self._gate_up()
        return interleaved_pair(w1, w3, dtype)

    def gate_up_operands(self, dtype):
        """(w1, w3) for the kernels without a copy: (the interleaved view, None) when the pair is
        packed, else the two tensors themselves (cast to dtype, contiguous), which the kernels read
        as gate/up halves (MoEWeights::w3)."""
        w1, w3 = self._gate_up()
        if _viewable(w1, w3, dtype):
            return _InterleavedView.apply(w1, w3), None
        return w1.to(dtype).contiguous(), w3.to(dtype).contiguous()


def init_experts_(weights, std, first_expert=0):
    """trunc_normal_(0, std) (torch's default cut at +-2, as torchtitan) into each [E_local, ...] weight
    of `weights`, expert by expert, each from its own generator keyed by (one draw from torch's default
    generator, the weight's place in `weights`, the global expert index first_expert + i). An expert's
    values thus do not depend on how the experts are split over ranks: after the same torch seed, rank
    r's local expert i at E/P experts per rank equals expert r * E/P + i of the one-GPU module, and no two
    ranks start with equal experts (with one torch generator per rank, every rank drew the same values
    into its own local experts). Meta tensors are skipped (initialised after to_empty)."""
    base = int(torch.randint(0, 2**62, (1,)).item())
    with torch.no_grad():
        for wi, w in enumerate(weights):
            if w.device.type == "meta":
                continue
            for i in range(w.shape[0]):
                key = (base * 1_000_003 + (first_expert + i) * len(weights) + wi) % (2**63 - 1)
                g = torch.Generator(device=w.device).manual_seed(key)
                torch.nn.init.trunc_normal_(w[i], mean=0.0, std=std, generator=g)


class GroupedExperts(PackedGateUp):
    """torchtitan's GroupedExperts parameters: w1 (gate) [E, n, d], w2 [E, d, n], w3 (up) [E, n, d];
    names, shapes and state-dict keys are torchtitan's. pack_gate_up=True: w1 and w3 are views of one
    [E, n, 2, d] storage (see above), so the kernels read bf16 ones with no per-step copy (not with a
    fused optimizer).

    mesh (a 1-D DeviceMesh over an expert-parallel group; num_experts is then this rank's count):
    the three parameters are DTensors of global shape [R * num_experts, ...], Shard(0) on the mesh,
    whose local shard is this rank's experts. DCP then saves and loads [E, ...] (at any EP size, or in
    one process), and a DTensor-aware clip (smoe_torch.ep_a2a.clip_grad_norm_) sees every expert's
    gradient. The kernels get the local shards (`_local`: differentiable, the gradient comes back as a
    Shard(0) DTensor). Not with pack_gate_up (a shard's storage is not ours to re-seat)."""

    def __init__(self, dim, hidden_dim, num_experts, pack_gate_up=False, mesh=None, first_expert=None):
        super().__init__()
        # first_expert: the global index of this rank's first expert (init_experts_); with a mesh, the
        # mesh's local rank * num_experts unless given; without, 0 (all experts here) unless given.
        if first_expert is None:
            first_expert = mesh.get_local_rank() * num_experts if mesh is not None else 0
        if not isinstance(first_expert, int) or first_expert < 0:
            raise ValueError(f"GroupedExperts: first_expert = {first_expert!r} must be an integer >= 0")
        self.first_expert = first_expert
        if mesh is not None:
            if mesh.ndim != 1:
                raise ValueError(f"GroupedExperts: mesh must be 1-D (the expert-parallel group), got {mesh.ndim} dims")
            if pack_gate_up:
                raise ValueError("GroupedExperts: pack_gate_up is not available with a mesh (DTensor shards stay dense)")
        self.num_experts = num_experts
        self.pack_gate_up = bool(pack_gate_up)
        self.mesh = mesh

        def param(*shape):
            if mesh is None:
                return torch.nn.Parameter(torch.empty(num_experts, *shape))
            from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415  (only with a mesh)
            # Even shards, so from_local infers the global shape; run_check=False: no collective.
            local = torch.empty(num_experts, *shape, device=mesh.device_type)
            return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))

        self.w1 = param(hidden_dim, dim)
        self.w2 = param(dim, hidden_dim)
        self.w3 = param(hidden_dim, dim)
        self._repack()
        self._register_repack_hook()

    mesh = None  # a class default, so modules pickled before the mesh existed still load

    def _local(self, w):
        """This rank's experts of w: its local shard if it is a DTensor, else w itself (also a plain
        tensor put in place of a mesh module's parameter, e.g. load_state_dict(..., assign=True))."""
        return w.to_local() if hasattr(w, "to_local") else w

    def _gate_up(self):
        return self._local(self.w1), self._local(self.w3)

    def w2_operand(self, dtype):
        """The kernels' [E_local, d, n] second projection in dtype."""
        return self._local(self.w2).to(dtype)

    first_expert = 0  # a class default, so modules pickled before it existed still load

    def init_weights(self, std=0.02):
        # With a mesh, the local shard itself (a DTensor init draws from DTensor's own RNG offsets); per
        # global expert index, so the plain EP module, the mesh one and the one-GPU module agree.
        init_experts_([self._local(w) for w in (self.w1, self.w2, self.w3)], std, self.first_expert)
