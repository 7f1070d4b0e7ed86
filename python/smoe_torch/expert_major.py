"""The expert-major MoE layer (include/smoe/expert_major.h) for PyTorch, and its pure-torch twin.

What the training stacks' dispatchers hand their experts: R rows x [R, d] already grouped by expert,
per-expert counts [E] on the device, optionally per-row probabilities [R]. Rows of expert e are
[begin(e), begin(e) + counts[e]) with begin(e) = counts[0] + ... + counts[e-1] (contiguous) or
segment_offset[e] (segmented, segment_offset [E+1]: capacity / alignment layouts); every other row is
PADDING: its output row, dx row and dprobs entry are 0, it adds nothing to any weight gradient, and
x / probs / dout are never read there (NaN allowed).

    out[r] = p[r] * (silu(g) * u) @ W2_e^T,   g, u = the gate / up projections of x[r] by expert e

  expert_major(x, counts, w1, w2, w3=None, *, probs=None, segment_offset=None, gate_up=None)
      the GPU layer (torch.ops.smoe.expert_major_fwd / _bwd, csrc/expert_major_ops.cpp) under a
      torch.autograd.Function: differentiable w.r.t. x, w1, w3, w2 and probs; traceable by
      torch.compile(fullgraph=True) (the ops' fakes are registered here).
  expert_major_ref(..., dtype=torch.float32)
      the same in plain torch on any device (CPU too): a loop over experts on host row ranges, math in
      `dtype`, output in x.dtype; autograd as usual.

gate_up (the first projection's layout, smoe::GateUpLayout):
  "interleaved"   w1 [E, 2n, d], row 2j = gate unit j, row 2j+1 = up unit j (this library's)
  "separate"      w1 = gate [E, n, d], w3 = up [E, n, d] (torchtitan's GroupedExperts)
  "concatenated"  w1 [E, 2n, d], rows [0, n) gate, [n, 2n) up (Megatron-Core fc1, transformers'
                  stacked gate_up_proj in nn.Linear orientation)
  None (default): "separate" when w3 is given, else "concatenated".
w2: [E, d, n]. The GPU layer takes bf16 x / weights (d, n multiples of 64, 1 <= E <= 512).

Conversions expert_major() makes (the standard layouts need none, so nothing is copied per step):
  * counts / segment_offset of another integer dtype are cast to int32, probs of another float
    dtype to float32 (its gradient flows back through the cast);
  * a non-contiguous x or weight (e.g. a transposed view) is COPIED with .contiguous() (the gradient
    flows back through the copy); pass contiguous tensors to avoid the copy;
  * DTensor weights (tensor / expert parallelism) run on their LOCAL tensor (.to_local()): the layer
    sees this rank's shard only, so w1.to_local().shape[0] must be the E of counts (the local
    experts). The gradients the op returns are local tensors; to_local's backward hands them to the
    DTensor parameters (as DTensors with the parameters' placements).
  * x, the weights and dout keep their dtype: bf16 is required (the op names a wrong one).

The device checks counts / segment_offset without a host sync: a negative count, a count past its
segment or past R, or a decreasing segment_offset makes every output NaN and sets
STATUS_INVALID_COUNTS in the extension's sticky per-device status record (one for both layers, so
smoe_torch.raise_if_nonfinite() sees it too); read it with expert_major_status() or
raise_if_expert_major_error() (one device sync; once per step, say).
expert_major_ref checks the same rules on the host and raises ValueError.

The saved state between forward and backward is an opaque uint8 tensor (H [R, 2n] bf16 + O(R + E)
indices: saved_state_bytes); x, probs and the weights are kept by reference and must not change
in place before backward (counts / segment_offset may: the saved state has what it needs).
"""
import torch
import torch.nn.functional as F

try:
    from . import _ops  # noqa: F401  (loads smoe_torch._C: torch.ops.smoe.*, this layer's ops included)
    from ._ops import _consume_saved  # the backward writes dH over the saved H where autograd frees it
except ImportError:  # loaded as a plain file, without its package (the CPU tests of expert_major_ref)
    def _consume_saved(saved, dout=None):
        return False

GATE_UP_LAYOUTS = {"interleaved": 0, "separate": 1, "concatenated": 2}  # smoe::GateUpLayout
STATUS_BAD_SAVED_STATE = 1 << 4   # smoe::kStatusBadSavedState (backward)
STATUS_INVALID_COUNTS = 1 << 5    # smoe::kStatusInvalidCounts (forward)
_WORKSPACE_ALIGNMENT = 256        # smoe::kWorkspaceAlignment


def _align(b):
    return (b + (_WORKSPACE_ALIGNMENT - 1)) // _WORKSPACE_ALIGNMENT * _WORKSPACE_ALIGNMENT


def saved_state_bytes(R, n, E):
    """smoe::expert_major_saved_state_size in Python (expert_major::saved_layout, src/expert_major/
    plan.cpp): the stamp (32 B), H bf16 [R][2n], expert_offset [E+1], row_of [R], slot_of [R],
    scores [R] fp32, row_offset [R+1], each region rounded up to 256 bytes. Independent of the
    layout, probs and segmentation. Symbolic in R for the fakes (torch.compile(dynamic=True))."""
    return (_align(32) + _align(R * 2 * n * 2) + _align((E + 1) * 4) + 3 * _align(R * 4)
            + _align((R + 1) * 4))


def _fwd_fake(x, counts, segment_offset, probs, w1, w3, w2, gate_up):
    saved = x.new_empty((saved_state_bytes(x.shape[0], w2.shape[2], w1.shape[0]),), dtype=torch.uint8)
    return torch.empty_like(x), saved


def _bwd_fake(dout, x, probs, w1, w3, w2, saved, gate_up, segmented, consume_saved=False):
    return (torch.empty_like(x), torch.empty_like(w1), None if w3 is None else torch.empty_like(w3),
            torch.empty_like(w2), None if probs is None else x.new_empty((x.shape[0],), dtype=torch.float32))


def _ops_available():
    return hasattr(torch.ops.smoe, "expert_major_fwd") and hasattr(torch.ops.smoe, "expert_major_bwd")


_fakes_registered = False


def _register_fakes():
    """Registers the ops' fakes once, if the extension has the ops (an older build may not). True
    when they are registered."""
    global _fakes_registered
    if not _fakes_registered and _ops_available():
        torch.library.register_fake("smoe::expert_major_fwd")(_fwd_fake)
        torch.library.register_fake("smoe::expert_major_bwd")(_bwd_fake)
        _fakes_registered = True
    return _fakes_registered


_register_fakes()


def _layout(gate_up, w3):
    """The GateUpLayout code of `gate_up` (None: "separate" with w3, else "concatenated"), checked
    against w3's presence."""
    if gate_up is None:
        gate_up = "separate" if w3 is not None else "concatenated"
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"expert_major: gate_up = {gate_up!r} must be one of {sorted(GATE_UP_LAYOUTS)} or None")
    if (gate_up == "separate") != (w3 is not None):
        raise ValueError("expert_major: w3 (up) must be given exactly when gate_up is 'separate' (got gate_up = "
                         f"{gate_up!r} and w3 {'given' if w3 is not None else 'None'})")
    return GATE_UP_LAYOUTS[gate_up]


def _local(t):
    """A DTensor's local tensor (differentiable: to_local's backward makes the gradient a DTensor
    again); any other tensor as it is. torch.distributed.tensor is imported only for a DTensor."""
    if t is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed: no DTensor exists
        return t
    return t.to_local() if isinstance(t, DTensor) else t


class _ExpertMajorFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, segment_offset, probs, w1, w3, w2, gate_up):
        out, saved = torch.ops.smoe.expert_major_fwd(x, counts, segment_offset, probs, w1, w3, w2, gate_up)
        ctx.save_for_backward(x, probs, w1, w3, w2, saved)
        ctx.gate_up = gate_up
        ctx.segmented = segment_offset is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        x, probs, w1, w3, w2, saved = ctx.saved_tensors
        dx, dw1, dw3, dw2, dprobs = torch.ops.smoe.expert_major_bwd(
            dout.contiguous(), x, probs, w1, w3, w2, saved, ctx.gate_up, ctx.segmented,
            _consume_saved(saved, dout))
        return dx, None, None, dprobs, dw1, dw3, dw2, None


def expert_major(x, counts, w1, w2, w3=None, *, probs=None, segment_offset=None, gate_up=None):
    """out [R, d] bf16 of the expert-major SwiGLU experts on the GPU (see the module docstring):
    x [R, d] bf16 grouped by expert; counts [E] (int32 on x's device; other integer dtypes are cast);
    w1 / w3 / w2 bf16 as `gate_up` says (None: "separate" with w3, else "concatenated"); probs [R]
    (fp32; other float dtypes cast) scales each row's activations before the down projection;
    segment_offset [E+1] (int32) selects the segmented layout. Differentiable w.r.t. x, w1, w3, w2
    and probs; padding rows get zeros."""
    code = _layout(gate_up, w3)
    if not _register_fakes():
        raise RuntimeError("expert_major: torch.ops.smoe.expert_major_fwd is missing: smoe_torch._C was built "
                           "without csrc/expert_major_ops.cpp (rebuild the extension)")
    w1, w3, w2 = _local(w1), _local(w3), _local(w2)
    x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
    w3 = None if w3 is None else w3.contiguous()
    counts = counts.to(torch.int32).contiguous()
    if segment_offset is not None:
        segment_offset = segment_offset.to(torch.int32).contiguous()
    if probs is not None:
        probs = probs.to(torch.float32).contiguous()
    return _ExpertMajorFunction.apply(x, counts, segment_offset, probs, w1, w3, w2, code)


def _like(device):
    return torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device()))


def expert_major_status(device=None):
    """The flags of the sticky device status (shared with the token-major layer) (STATUS_INVALID_COUNTS, STATUS_BAD_SAVED_STATE)
    since the last reset. Reading it syncs the device."""
    raw = torch.ops.smoe.expert_major_status(_like(device)).cpu()
    return int(raw[0:4].view(torch.int32).item()) & 0xFFFFFFFF


def reset_expert_major_status(device=None):
    """Clear the sticky device status, both layers' flags (enqueued on the current stream)."""
    torch.ops.smoe.expert_major_reset_status(_like(device))


def raise_if_expert_major_error(device=None, reset=True):
    """Raise RuntimeError if a forward since the last reset had invalid counts / segment_offset (its
    outputs are NaN) or a backward got a saved state of another forward. One device sync; reset=True
    clears the record after reading it."""
    flags = expert_major_status(device)
    if reset:
        reset_expert_major_status(device)
    what = []
    if flags & STATUS_INVALID_COUNTS:
        what.append("invalid counts / segment_offset (a negative count, a count past its segment or past R, or a "
                    "decreasing segment_offset): that call's outputs are NaN")
    if flags & STATUS_BAD_SAVED_STATE:
        what.append("a backward got a saved state not written by expert_major_fwd for its shape: its gradients are NaN")
    if what:
        raise RuntimeError("smoe: expert_major: " + "; ".join(what))


def expert_major_row_ranges(counts, segment_offset, R):
    """[(begin, count)] per expert on the host (one sync for device tensors), as expert_major.h defines
    them; raises ValueError for counts the GPU layer would flag (STATUS_INVALID_COUNTS)."""
    c = [int(v) for v in torch.as_tensor(counts).reshape(-1).tolist()]
    E = len(c)
    if segment_offset is not None:
        off = [int(v) for v in torch.as_tensor(segment_offset).reshape(-1).tolist()]
        if len(off) != E + 1:
            raise ValueError(f"expert_major: segment_offset must have E + 1 = {E + 1} entries (got {len(off)})")
        if off[0] < 0 or off[E] > R:
            raise ValueError(f"expert_major: segment_offset must lie in [0, R = {R}] (got {off[0]} .. {off[E]})")
        for e in range(E):
            if off[e + 1] < off[e]:
                raise ValueError(f"expert_major: segment_offset decreases at expert {e}: {off[e]} > {off[e + 1]}")
    ranges, nxt = [], 0
    for e in range(E):
        b = off[e] if segment_offset is not None else nxt
        end = off[e + 1] if segment_offset is not None else R
        if c[e] < 0 or b + c[e] > end:
            where = f"its segment [{b}, {end})" if segment_offset is not None else f"R = {R} rows"
            raise ValueError(f"expert_major: counts[{e}] = {c[e]} (rows from {b}) is negative or runs past {where}")
        ranges.append((b, c[e]))
        nxt = b + c[e]
    return ranges


def expert_major_ref(x, counts, w1, w2, w3=None, *, probs=None, segment_offset=None, gate_up=None,
                     dtype=torch.float32):
    """expert_major in plain torch, any device and dtype: math in `dtype`, output in x.dtype. Row
    ranges come from counts / segment_offset on the host (a sync); only valid rows are read
    (index_select), so padding rows, whatever they hold (NaN included), give zero output and zero
    gradients. Differentiable w.r.t. x, w1, w3, w2, probs by ordinary autograd (experts without rows
    still take part, with zero rows, so every weight gets a gradient, zeros there)."""
    code = _layout(gate_up, w3)
    w1, w3, w2 = _local(w1), _local(w3), _local(w2)
    if x.dim() != 2:
        raise ValueError(f"expert_major_ref: x must be [R, d] (got shape {tuple(x.shape)})")
    R, d = x.shape
    E = w1.shape[0]
    n = w2.shape[2]
    if torch.as_tensor(counts).numel() != E:
        raise ValueError(f"expert_major_ref: counts must have E = w1.shape[0] = {E} entries")
    ranges = expert_major_row_ranges(counts, segment_offset, R)
    w1c, w2c = w1.to(dtype), w2.to(dtype)
    w3c = None if w3 is None else w3.to(dtype)
    rows_all, ys = [], []
    for e, (b, c) in enumerate(ranges):
        rows = torch.arange(b, b + c, device=x.device)
        xe = x.index_select(0, rows).to(dtype)
        if code == GATE_UP_LAYOUTS["separate"]:
            g, u = xe @ w1c[e].T, xe @ w3c[e].T
        else:
            h = xe @ w1c[e].T
            g, u = (h[:, 0::2], h[:, 1::2]) if code == GATE_UP_LAYOUTS["interleaved"] else (h[:, :n], h[:, n:])
        a = F.silu(g) * u
        if probs is not None:
            a = a * probs.index_select(0, rows).to(dtype)[:, None]
        rows_all.append(rows)
        ys.append(a @ w2c[e].T)
    out = x.new_zeros((R, d), dtype=dtype).index_copy(0, torch.cat(rows_all), torch.cat(ys))
    return out.to(x.dtype)
