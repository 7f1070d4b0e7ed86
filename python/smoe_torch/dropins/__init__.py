"""Drop-ins: the expert-major layer (smoe_torch.expert_major) under three training stacks.

  smoe_torch.dropins.torchtitan    torchtitan 0.3.0: SmoeGroupedExperts (a GroupedExperts subclass, the
                                   same parameters and state-dict keys), the `smoe_grouped_experts`
                                   @override for `--override.imports`, swap_grouped_experts(model)
  smoe_torch.dropins.megatron      Megatron-Core 0.16.1: megatron_grouped_mlp(...) with GroupedMLP /
                                   TEGroupedMLP's forward inputs and outputs, patch_megatron_experts(model)
  smoe_torch.dropins.transformers  transformers 5.24.0: the "smoe" experts implementation
                                   (register(); then experts_implementation="smoe")

Each submodule imports its framework only when it is imported itself (and works without it where it
can: the torchtitan / Megatron functions take plain tensors). Every call goes through
smoe_torch.expert_major looked up at call time, so a test can monkeypatch it with
smoe_torch.expert_major_ref and run the wiring on a CPU.
"""
import importlib

import torch

__all__ = ["torchtitan", "megatron", "transformers"]


def expert_major(*args, **kwargs):
    """smoe_torch.expert_major, looked up at each call (monkeypatchable)."""
    import smoe_torch
    return smoe_torch.expert_major(*args, **kwargs)


def device_counts(counts, device):
    """Per-expert counts as int32 on `device` (from a CPU or GPU tensor, or a list): no host sync
    when they already live on the device."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int32)
    return counts.to(device=device, dtype=torch.int32, non_blocking=True)


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
