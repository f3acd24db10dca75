"""Activation-checkpoint offload: keep the inputs saved for each decoder layer's recompute on the host.

With gradient checkpointing, each decoder layer keeps only what its checkpoint saves, its input
hidden states `[bs, sl, h]`, and recomputes the rest in backward. At long sequence lengths those
per-layer inputs (layers x bs x sl x h) become the largest resident activation, so ALST moves them to
CPU memory ("activation checkpoint offload"). Here every checkpointed layer's checkpoint function is
wrapped in a `torch.autograd.graph.saved_tensors_hooks` pair: what the checkpoint saves is copied to
pinned host memory (non-blocking) in forward and copied back to its device when the recompute unpacks
it in backward. Tensors inside the checkpointed region are not saved at all (the checkpoint recomputes
them), so only the checkpoint's own inputs move. On CPU the copy is the identity, but the same hooks
run.

The cost is one device-to-host copy per layer in forward and one host-to-device copy in backward,
issued on the current stream.
"""

import torch
from torch import nn

__all__ = ["enable_activation_checkpoint_offload", "disable_activation_checkpoint_offload"]

_ENABLED_BY_US = "_ds_ulysses_checkpointing_enabled_by_offload"


def enable_activation_checkpoint_offload(model):
    """Offload the checkpointed inputs of every gradient-checkpointed layer of a HF `model` to the host.

    Turns gradient checkpointing on first if it is off (non-reentrant, the mode that composes with
    ZeRO-3 and with saved-tensor hooks). `model` may be the HF model or anything containing it (a
    PEFT wrapper, a DeepSpeed engine). Idempotent; returns how many layers offload. Call it again
    after a later `gradient_checkpointing_enable()`, which installs fresh checkpoint functions.
    """
    if not _checkpointing_on(model):
        owner = _checkpointing_owner(model)
        enable = getattr(owner, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        setattr(owner, _ENABLED_BY_US, True)
    count = 0
    for module in _checkpointed_layers(model):
        if not isinstance(module._gradient_checkpointing_func, _OffloadedCheckpoint):
            module._gradient_checkpointing_func = _OffloadedCheckpoint(module._gradient_checkpointing_func)
        count += 1
    return count


def disable_activation_checkpoint_offload(model):
    """Undo `enable_activation_checkpoint_offload`: restore each layer's checkpoint function, and turn
    gradient checkpointing back off if the enable call turned it on. Idempotent; returns how many
    layers were restored."""
    count = 0
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _OffloadedCheckpoint):
            module._gradient_checkpointing_func = func.checkpoint
            count += 1
    for module in model.modules():
        if module.__dict__.pop(_ENABLED_BY_US, False):
            if hasattr(module, "activation_checkpointing_disable"):
                module.activation_checkpointing_disable()
            else:
                module.gradient_checkpointing_disable()
    return count


class _OffloadedCheckpoint:
    """A layer's checkpoint function, run with pack/unpack hooks that move what it saves to the host."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def __call__(self, function, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_to_device):
            return self.checkpoint(function, *args, **kwargs)


def _pack_to_host(tensor):
    """Host copy of a saved tensor with the device to return it to. Parameters stay where they are:
    they are resident anyway, and ZeRO-3 swaps their storage."""
    if isinstance(tensor, nn.Parameter):
        return tensor.device, tensor
    return tensor.device, _to_host(tensor)


def _unpack_to_device(packed):
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


def _to_host(tensor):
    """Copy to CPU: into pinned memory with a non-blocking copy from CUDA; the tensor itself on CPU."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                       pin_memory=tensor.device.type == "cuda")
    host.copy_(tensor, non_blocking=True)
    return host


def _checkpointed_layers(model):
    """The decoder layers that checkpoint themselves; models of the older style, whose layer loop
    calls the checkpoint function, have none, and then every module holding one is wrapped."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    holders = [m for m in model.modules()
               if getattr(m, "gradient_checkpointing", False) is True and hasattr(m, "_gradient_checkpointing_func")]
    return [m for m in holders if isinstance(m, GradientCheckpointingLayer)] or holders


def _checkpointing_on(model):
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _checkpointing_owner(model):
    """The outermost module that can switch gradient checkpointing on (the HF PreTrainedModel)."""
    for module in model.modules():
        if hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable"):
            return module
    raise ValueError(f"activation checkpoint offload needs a HuggingFace model with gradient checkpointing "
                     f"support, got {type(model).__name__} with none inside; pass the PreTrainedModel (or a "
                     "wrapper containing it)")
