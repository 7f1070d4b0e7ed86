"""The sizes of the library's opaque buffers, in one place for the whole package: the ops' fakes
(_ops.py), smoe_torch.saved_state_bytes and smoe_torch.ep.

The fakes need the saved state's size as an expression of T, so that torch.compile(dynamic=True)
compiles once for every sequence length; a C++ size query takes ints, and passing it a symbolic T
would specialise on it. The T-dependent arithmetic is therefore written here once, in Python, each
function naming the C++ layout it mirrors, and tested against the C++ query
(tests/python/test_torch_moe.py::test_fake_saved_size_matches_the_library, tests/python/test_ep.py).
What does not depend on T is asked of C++: the token-rounding row tile (_C.token_rounding_tile) and an
EP group's local-layer saved state (_C.saved_state_size, once when the group is created).

No workspace size is computed in Python: the ops allocate their forward / backward workspaces in C++
(csrc/ops.cpp: smoe::moe_*_workspace_size; csrc/ep_ops.cpp: smoe::ep_*_workspace_size) and the fakes
allocate none, so changes to src/moe/memory_plan.cpp's workspaces need nothing here.
"""
import collections

import torch

# smoe::MoERouter (include/smoe/smoe.h): the `router` code of saved_state_bytes and of _C's queries.
ROUTER_TOPK_SOFTMAX, ROUTER_TOKEN_ROUNDING, ROUTER_PROVIDED = 0, 1, 2
ROUNDING_DOWN = 2  # smoe::TokenRoundingMode::kDown: rounds every count down, so never adds a row

WORKSPACE_ALIGNMENT = 256  # smoe::kWorkspaceAlignment


def align(b):
    """b rounded up to WORKSPACE_ALIGNMENT: smoe::detail::align_workspace (src/common/check.h), what
    detail::Carver (src/common/workspace.h) rounds every region to. Symbolic b stays symbolic."""
    return (b + (WORKSPACE_ALIGNMENT - 1)) // WORKSPACE_ALIGNMENT * WORKSPACE_ALIGNMENT


_row_tile = None


def row_tile():
    """The M tile token rounding rounds to (engine::kRowTile), asked of C++ once."""
    global _row_tile
    if _row_tile is None:
        from . import _C
        _row_tile = int(_C.token_rounding_tile())
    return _row_tile


def saved_state_bytes(T, n, E, K, router=ROUTER_TOPK_SOFTMAX, rounding=0, tile=None):
    """smoe::moe_saved_state_size in Python: plan::saved_layout in src/moe/memory_plan.cpp (the stamp,
    H, scores, top-K ids, [token rounding: entry experts, top-K scores,] scatter / reverse-scatter /
    gather indices, token offsets, expert frequency and offsets; every region rounded to 256 bytes).
    Rows: moe_row_capacity, T*K, or with token rounding (not DOWN) token_rounding_capacity's
    min(T*E, T*K + E*(tile-1)) (src/routing/token_rounding.cu, capacity_of). tile None: the library's
    (row_tile()). Symbolic in T for the fakes; for a valid shape equal to _C.saved_state_size (which
    returns 0 for an invalid one)."""
    tk = T * K
    rows = tk
    if router == ROUTER_TOKEN_ROUNDING and rounding != ROUNDING_DOWN:  # worst case of the rounded counts
        if tile is None:
            tile = row_tile()
        rows = torch.sym_min(T * E, tk + E * (tile - 1))
    b = align(32)                                   # plan::SavedStamp (magic, shape hash, size, reserved)
    b += align(rows * 2 * n * 2) + align(rows * 4) + align(tk * 4)   # H bf16 [rows][2n], scores, top-K ids
    if router == ROUTER_TOKEN_ROUNDING:
        b += align(rows * 4) + align(tk * 4)        # entry experts, top-K scores
    b += 3 * align(rows * 4) + align((T + 1) * 4) + align(E * 4) + align((E + 1) * 4)
    return b


# EP groups: what ep_saved_state_bytes needs of a context, by its handle (EpGroup registers it).
EpSaved = collections.namedtuple("EpSaved", "layer_bytes world top_k")
_ep_groups = {}


def register_ep_group(handle, layer_bytes, world, top_k):
    """layer_bytes: the local layer's saved state, moe_saved_state_size(ctx->local_shape) (asked of
    C++); world: R; top_k: the group's (global) K."""
    _ep_groups[handle] = EpSaved(int(layer_bytes), int(world), int(top_k))


def forget_ep_group(handle):
    _ep_groups.pop(handle, None)


def ep_top_k(handle):
    return _ep_groups[handle].top_k


def ep_saved_state_bytes(handle, T):
    """smoe::ep_saved_state_size in Python: saved_layout in src/ep/ep_layer.cpp (the local layer's
    saved state over the receive capacity, then all_counts [R][R], send_pos [R][T] and the sanitised
    ids [T][K], int32, each region rounded to 256 bytes), symbolic in T for torch.compile. Tested
    against the C++ query (tests/python/test_ep.py)."""
    g = _ep_groups[handle]
    R = g.world
    return align(g.layer_bytes) + align(R * R * 4) + align(R * T * 4) + align(T * g.top_k * 4)
