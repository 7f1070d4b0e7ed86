"""The extension's per-device runtime helpers: the sticky numerical status and the library handle
(csrc/ops.cpp: nonfinite_status, reset_nonfinite_status, init). Re-exported by smoe_torch."""
import torch

from . import _C


def nonfinite_status(device=None):
    """(flags, nonfinite_tokens, first_token) of the sticky device status. Reading it syncs."""
    like = torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device()))
    raw = _C.nonfinite_status(like).cpu()
    flags = int(raw[0:4].view(torch.int32).item()) & 0xFFFFFFFF
    count = int(raw[4:8].view(torch.int32).item()) & 0xFFFFFFFF
    first = int(raw[8:16].view(torch.int64).item())
    return flags, count, first


# smoe::DeviceStatusFlag. One record per device for both layers (csrc/common.h): the expert-major
# layer's flags show here too.
_FLAG_NAMES = {1: "non-finite router logits", 2: "expert id outside [-1, E)", 4: "expert listed twice in a token",
               8: "non-finite routing scores",
               16: "a backward got a saved state not written by the forward for its shape, or one an earlier backward "
                   "spent (consume_saved; its gradients are NaN)",
               32: "expert-major counts / segment_offset invalid (that forward's outputs are NaN)"}


def reset_nonfinite_status(device=None):
    """Clear the sticky device status (flags, count, first token)."""
    _C.reset_nonfinite_status(torch.empty(0, device=device or torch.device("cuda", torch.cuda.current_device())))


def raise_if_nonfinite(device=None, reset=True):
    """Raise FloatingPointError if any call since the last reset saw NaN/Inf router logits (or, with
    provided routing, a bad id or score, naming the first token), a bad saved state, or invalid
    expert-major counts. One device sync: call it once per
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
