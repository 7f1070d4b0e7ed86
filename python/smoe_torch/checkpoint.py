"""Selective activation checkpointing around the smoe layers.

A checkpointed block recomputes its forward inside backward. For an MoE block that would run the
whole MoE layer again (router, up- and down-projection GEMMs) to rebuild a saved state that is
already small: the layer keeps H [rows, 2n] and O(rows) indices, no O(T*K*d) tensor. So the policy
here saves the outputs of the smoe forward ops (out and the opaque saved state) and recomputes
everything else (attention, norms, dense projections), which is the trade torchtitan's selective
AC makes for its grouped GEMMs:

    from torch.utils.checkpoint import checkpoint
    import smoe_torch.checkpoint as sc
    y = checkpoint(block, x, use_reentrant=False, context_fn=sc.context_fn())

context_fn(save=...) adds ops to keep (e.g. torch.ops.aten._scaled_dot_product_flash_attention.default).
The recompute still runs the module's Python code (or its compiled graph), so MoE counts its tokens
through smoe::count_tokens_once (_ops.py), which skips while a backward runs (counted once). Needs
use_reentrant=False (selective checkpointing is built on the non-reentrant implementation).
"""
import functools

import torch

__all__ = ["policy", "context_fn"]


def _forward_ops():
    """The smoe forward ops this extension defines (the EP op only when smoe_torch._ep is built)."""
    names = ("moe_forward", "moe_forward_routed", "moe_forward_tr", "expert_major_fwd", "ep_forward")
    ops = torch.ops.smoe
    return frozenset(getattr(ops, n).default for n in names if hasattr(ops, n))


def policy(save=()):
    """A policy_fn for create_selective_checkpoint_contexts: MUST_SAVE the smoe forward ops and `save`,
    PREFER_RECOMPUTE the rest. The op set is read when the policy is made (so the EP op counts once
    smoe_torch.ep has loaded it)."""
    from torch.utils.checkpoint import CheckpointPolicy
    keep = _forward_ops() | frozenset(save)

    def _policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return _policy


def context_fn(save=()):
    """The context_fn argument of torch.utils.checkpoint.checkpoint for this policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return functools.partial(create_selective_checkpoint_contexts, policy(save))
