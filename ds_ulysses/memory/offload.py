"""Activation-checkpoint offload: keep the inputs saved for each decoder layer's recompute on the host.

With gradient checkpointing, each decoder layer keeps only what its checkpoint saves, its input
hidden states `[bs, sl, h]`, and recomputes the rest in backward. At long sequence lengths those
per-layer inputs (layers x bs x sl x h) become the largest resident activation, so ALST moves them to
CPU memory ("activation checkpoint offload"). :class:`OffloadedCheckpoint` wraps a checkpoint
function in a `torch.autograd.graph.saved_tensors_hooks` pair: what the checkpoint saves is copied to
pinned host memory (non-blocking) in forward and copied back to its device when the recompute unpacks
it in backward. Tensors inside the checkpointed region are not saved at all (the checkpoint recomputes
them), so only the checkpoint's own inputs move. On CPU the copy is the identity, but the same hooks
run. :func:`ds_ulysses.hf.checkpointing.enable_activation_checkpoint_offload` installs it on a
Transformers model's checkpointed layers.

The cost is one device-to-host copy per layer in forward and one host-to-device copy in backward,
issued on the current stream.
"""

import torch
from torch import nn

__all__ = ["OffloadedCheckpoint"]


class OffloadedCheckpoint:
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
