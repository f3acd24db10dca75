"""Activation-checkpoint offload on a Transformers model: every gradient-checkpointed layer's
checkpoint function runs under :class:`~ds_ulysses.memory.offload.OffloadedCheckpoint`, so the
inputs each layer saves for its recompute wait in host memory."""

from ..memory.offload import OffloadedCheckpoint
from ..patching import PATCHES

__all__ = ["enable_activation_checkpoint_offload", "disable_activation_checkpoint_offload",
           "check_checkpoint_offload", "checkpointing_on"]

_TAG = "checkpoint_offload"


def enable_activation_checkpoint_offload(model, layers="all"):
    """Offload the checkpointed inputs of the gradient-checkpointed layers of a HF `model` to the host:
    every one, or the first `layers` (an int: the others keep theirs on the device, for a host that cannot
    hold one hidden-sized tensor per token for every layer).

    Turns gradient checkpointing on first if it is off (non-reentrant, the mode that composes with
    ZeRO-3 and with saved-tensor hooks). `model` may be the HF model or anything containing it (a
    PEFT wrapper, a DeepSpeed engine). Idempotent; returns how many layers offload (a later call with fewer
    `layers` stops the rest). Call it again after a later `gradient_checkpointing_enable()`, which installs
    fresh checkpoint functions.
    Undone by `disable_activation_checkpoint_offload` or `ds_ulysses.uninstall`.
    """
    check_checkpoint_offload(model)
    if layers != "all" and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise ValueError(f"activation checkpoint offload: layers must be \"all\" or a count >= 0, got {layers!r}; "
                         "pass e.g. layers=16 to offload the first 16 layers' checkpoints")
    if not checkpointing_on(model):
        owner = _checkpointing_owner(model)
        enable = getattr(owner, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
            PATCHES.on_undo(owner.activation_checkpointing_disable, _TAG, owner=model)
        else:
            owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            PATCHES.on_undo(owner.gradient_checkpointing_disable, _TAG, owner=model)
    checkpointed = _checkpointed_layers(model)
    count = len(checkpointed) if layers == "all" else min(layers, len(checkpointed))
    for module in checkpointed[count:]:  # one an earlier call offloaded stops
        _unwrap(module)
    for module in checkpointed[:count]:
        if not isinstance(module._gradient_checkpointing_func, OffloadedCheckpoint):
            module._gradient_checkpointing_func = OffloadedCheckpoint(module._gradient_checkpointing_func)
            PATCHES.on_undo(lambda module=module: _unwrap(module), _TAG, owner=model)
    return count


def check_checkpoint_offload(model) -> None:
    """Raise unless :func:`enable_activation_checkpoint_offload` can serve `model`: its layers are
    checkpointed already, or it is a model Transformers can checkpoint (``supports_gradient_checkpointing``)."""
    if checkpointing_on(model):
        return
    owner = _checkpointing_owner(model)
    if getattr(owner, "supports_gradient_checkpointing", True) is False:
        raise ValueError(
            f"activation checkpoint offload needs gradient checkpointing, and {type(owner).__name__} does not "
            "support it (supports_gradient_checkpointing is False); expected a model whose layers Transformers can "
            "checkpoint; fix: set \"activation_checkpoint_offload\": {\"enabled\": false} (or do not call "
            "enable_activation_checkpoint_offload for this model)")


def disable_activation_checkpoint_offload(model):
    """Undo `enable_activation_checkpoint_offload`: restore each layer's checkpoint function, and turn
    gradient checkpointing back off if the enable call turned it on. Idempotent; returns how many
    layers were restored."""
    count = sum(isinstance(m.__dict__.get("_gradient_checkpointing_func"), OffloadedCheckpoint)
                for m in model.modules())
    PATCHES.undo(_TAG, owner=model)
    return count


def _unwrap(module) -> None:
    func = module.__dict__.get("_gradient_checkpointing_func")
    if isinstance(func, OffloadedCheckpoint):
        module._gradient_checkpointing_func = func.checkpoint


def _checkpointed_layers(model):
    """The decoder layers that checkpoint themselves; models of the older style, whose layer loop
    calls the checkpoint function, have none, and then every module holding one is wrapped."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    holders = [m for m in model.modules()
               if getattr(m, "gradient_checkpointing", False) is True and hasattr(m, "_gradient_checkpointing_func")]
    return [m for m in holders if isinstance(m, GradientCheckpointingLayer)] or holders


def checkpointing_on(model):
    """Whether any module of ``model`` has Transformers' gradient checkpointing switched on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _checkpointing_owner(model):
    """The outermost module that can switch gradient checkpointing on (the HF PreTrainedModel)."""
    for module in model.modules():
        if hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable"):
            return module
    raise ValueError(f"activation checkpoint offload needs a HuggingFace model with gradient checkpointing "
                     f"support, got {type(model).__name__} with none inside; pass the PreTrainedModel (or a "
                     "wrapper containing it)")
