"""Accelerate and Transformers' Trainer: the ``"ulysses"`` section and ``parallelism_config`` as one SP switch.

Transformers documents one way to train with Ulysses SP: ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=N))``. Accelerate then imports DeepSpeed's
``UlyssesSPAttentionHF`` / ``UlyssesSPDataLoaderAdapter`` at call time, registers the attention,
fixes DeepSpeed's batch arithmetic, wraps the train loader and calls ``deepspeed.initialize(mpu=...)``;
the Trainer computes the loss with ``deepspeed_sp_compute_loss``. After :func:`ds_ulysses.install`:

- DeepSpeed's two names point at ours (``engine.install``), so that code runs our attention and adapter;
- an ``Accelerator`` whose DeepSpeed config has a ``"ulysses"`` section gets the equivalent
  ``parallelism_config``, and one given with ``parallelism_config`` alone gets the equivalent section
  (:func:`reconcile`), so Accelerate's SP plumbing and :func:`ds_ulysses.initialize` (behind the patched
  ``deepspeed.initialize``) both run, from either switch; a section and a ``parallelism_config`` that
  disagree are refused naming both values; ``parallelism_config`` alone outside the Trainer gives the
  model DeepSpeed's outputs (logits, no loss: ``model_loss`` off), which the user's loop written for
  DeepSpeed takes its loss from, and DeepSpeed's steps (no ``trim_host_heap``);
- the Trainer's SP loss is the model's own (:func:`sp_compute_loss`): Transformers' weights per-rank
  mean losses through a differentiable all_gather, which is exact only under ZeRO-3's reduction
  (an average over all ranks) and twice the gradient at sp 2 under ZeRO-1/2 (a sum over SP peers);
- the step's loss is weighted by tokens as the Trainer without SP weights it (:func:`step_tokens`,
  :func:`token_weight`): Transformers' SP path drops ``num_items_in_batch`` and averages micro-batch
  means instead, which differs from non-SP training as soon as micro-batches (over the accumulation
  window and the DP replicas) hold different numbers of labelled tokens; a MoE router's load-balancing
  loss is weighted as the Trainer (or TRL's fused head) weights it without SP (:func:`router_weight`);
- the Trainer options its SP loss would drop silently, label smoothing and ``compute_loss_func``, are
  refused when training starts, before the engine is built (:func:`refuse_dropped_loss_features`), and a
  trainer whose ``compute_loss`` never reaches the Trainer's (TRL's DPOTrainer, KTOTrainer, ...: a loss
  per sample, not per token) at its first training forward (:func:`_train`);
- NEFTune's noise is bounded by the whole sequence's length, not a shard's (:func:`activate_neftune`);
- the Trainer's resume skips into the adapter (:func:`skip_first_batches`), which Accelerate's
  version cannot (the adapter is not a DataLoader), and a resume on another mesh is refused before any
  step when the skip would not continue the run (:mod:`ds_ulysses.hf.resume`);
- a section with ``ring_size`` other than 1 gets its ring from Accelerate's registration and loaders
  (:mod:`ds_ulysses.hf.accelerate_ring`); a ring with a core other than sdpa is refused when the
  Accelerator is built.

Evaluation under Accelerate runs without SP: Accelerate registers the attention with
``disable_in_eval=True`` and the Trainer's evaluation loop gives each rank whole samples (labels,
logits and metrics per sample), so each rank evaluates its own samples in full, exactly. A batch the
adapter sharded reaching the model in eval mode is refused (the hook in :mod:`ds_ulysses.hf.decoder_watch`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import weakref

import torch
import torch.distributed as dist

from ..config import UlyssesConfig, parse_ds_config
from ..config.schema import SECTION_KEY
from ..constants import IGNORE_INDEX
from ..distributed.collectives import all_reduce_sum
from ..distributed.mesh import Mesh, mesh_shape
from ..patching import PATCHES
from ..sp.data import UlyssesSPDataLoaderAdapter
from ..sp.ring import check_ring_core
from .accelerate_ring import prepare_deepspeed, ulysses_dl_adapter
from .decoder_watch import unserved_loss_scope
from .resume import check_trainer_resume
from .router_loss import router_coef

__all__ = ["reconcile", "serve_the_trainer_s_loss", "sp_compute_loss", "skip_first_batches", "install_accelerate",
           "step_tokens", "token_weight", "router_weight", "refuse_dropped_loss_features", "activate_neftune"]

_DEEPSPEED_S_OUTPUTS: weakref.WeakSet = weakref.WeakSet()  # Accelerators reconciled from parallelism_config alone


def _pc_values(pc) -> dict:
    """What a parallelism_config says about SP, with None for what it leaves to the section."""
    handler = pc.sp_handler if pc is not None and pc.sp_size > 1 else None
    fixed = handler is not None and not handler.sp_seq_length_is_variable
    return {"sequence_parallel_size": pc.sp_size if pc is not None and pc.sp_size > 1 else None,
            "attn_implementation": handler.sp_attn_implementation if handler is not None else None,
            "seq_length_is_variable": False if fixed else None,
            "seq_length": handler.sp_seq_length if fixed else None}


def _merge(section: UlyssesConfig | None, pc) -> UlyssesConfig:
    """One section from both switches: the parallelism_config's unset fields come from the section, the
    ones it sets must equal the section's (a ValueError names both values otherwise)."""
    given = {k: v for k, v in _pc_values(pc).items() if v is not None}
    if section is None:
        return UlyssesConfig(**given, disable_in_eval=True)
    for name, value in given.items():
        if getattr(section, name) != value:
            pc_name = {"sequence_parallel_size": "sp_size", "attn_implementation": "sp_handler.sp_attn_implementation",
                       "seq_length_is_variable": "sp_handler.sp_seq_length_is_variable",
                       "seq_length": "sp_handler.sp_seq_length"}[name]
            raise ValueError(
                f"Accelerate's parallelism_config has {pc_name}={value!r} but the DeepSpeed config's \"ulysses\" "
                f"section has {name}={getattr(section, name)!r}; expected the two SP switches to agree; fix: make "
                "them equal, or give only one (either alone configures the same SP)")
    return dataclasses.replace(section, disable_in_eval=True)


def _parallelism_config(section: UlyssesConfig, pc, world_size: int):
    """Accelerate's ParallelismConfig equivalent to ``section`` (keeping what ``pc`` says beyond SP)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    dp, sp = mesh_shape(world_size, section.sp, section.mesh_param)
    kept = {k: getattr(pc, k) for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend")
            } if pc is not None else {}
    if pc is not None and pc.data_parallel_size not in (1, dp):
        raise ValueError(
            f"Accelerate's parallelism_config has a data-parallel size of {pc.data_parallel_size} (dp_replicate_size="
            f"{pc.dp_replicate_size} x dp_shard_size={pc.dp_shard_size}) but {world_size} ranks at sp={sp} give "
            f"dp={dp}; expected dp x sp == world size; fix: set dp_shard_size={dp} (or leave the dp sizes out)")
    if pc is None or pc.data_parallel_size == 1:
        kept.update(dp_replicate_size=1, dp_shard_size=dp)  # Accelerate sizes DeepSpeed's train_batch_size with it
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=section.seq_length,
                                              sp_seq_length_is_variable=section.seq_length_is_variable,
                                              sp_attn_implementation=section.attn_implementation)
    return ParallelismConfig(**kept, sp_size=sp, sp_backend="deepspeed", sp_handler=handler)


def reconcile(accelerator) -> None:
    """Give ``accelerator`` both SP switches from whichever it was given: the section (in its DeepSpeed
    config, read by :func:`ds_ulysses.initialize`) and ``parallelism_config`` (read by Accelerate and the
    Trainer: loader wrapping, batch arithmetic, step counts, the SP loss). No-op without either.

    A section made from ``parallelism_config`` alone has the defaults but ``model_loss``, the tiled loss and
    ``trim_host_heap``: in a loop of the user's own, code written for DeepSpeed's SP path takes its loss from
    ``model(**batch).logits`` and the batch's ``shift_labels`` (Accelerate's ALST example, DeepSpeed's
    tutorial), so the model returns what DeepSpeed's module makes it return, logits and no loss, and
    computes nothing that code does not use; and the engine's step is DeepSpeed's, without the heap trim
    that trades a step's page refaults for memory (docs/config.md, trim_host_heap). The Trainer,
    which takes the model's loss, gets all three back when it trains (:func:`serve_the_trainer_s_loss`)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    _, section = parse_ds_config(plugin.deepspeed_config)
    pc = accelerator.state.parallelism_config
    if section is None and (pc is None or pc.sp_size <= 1):
        return
    merged = _merge(section, pc)
    check_ring_core(merged.attn_implementation, merged.ring_size)
    if section is None:  # DeepSpeed's switch: in the user's own loop the model's outputs and steps are DeepSpeed's
        merged = dataclasses.replace(merged, model_loss=False, trim_host_heap=False,
                                     tiled_loss=dataclasses.replace(merged.tiled_loss, enabled=False))
        _DEEPSPEED_S_OUTPUTS.add(accelerator)
    world = dist.get_world_size() if dist.is_initialized() else accelerator.num_processes
    accelerator.state.parallelism_config = _parallelism_config(merged, pc, world)
    plugin.deepspeed_config[SECTION_KEY] = _changed(merged.to_dict(), UlyssesConfig().to_dict())


def serve_the_trainer_s_loss(accelerator) -> None:
    """Before a Trainer trains (and builds its engine): its loss is the model's (:func:`sp_compute_loss`) and
    nothing reads the logits, so a section :func:`reconcile` made from ``parallelism_config`` alone gets its
    defaults back (``model_loss``, the tiled loss, ``trim_host_heap``), on the DeepSpeed config the Trainer has
    by then (its own copy of the one reconciled); a section whose ``model_loss`` is false is refused."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    section = plugin.deepspeed_config.get(SECTION_KEY) if plugin is not None else None
    if section is None:
        return
    if accelerator in _DEEPSPEED_S_OUTPUTS:
        for key in ("model_loss", "tiled_loss", "trim_host_heap"):
            section.pop(key, None)
    elif section.get("model_loss") is False:
        raise ValueError(
            "the DeepSpeed config's \"ulysses\" section has model_loss false, but Transformers' Trainer computes its "
            "SP loss from the model's (model(**inputs).loss); expected model_loss true (the default) under the "
            "Trainer; fix: drop model_loss from the section")


def _changed(values: dict, defaults: dict) -> dict:
    """The fields that differ from the defaults. Accelerate fills in or rejects every "auto" value of its
    DeepSpeed config, and "auto" is only ever the section's default, so the section is handed on sparse."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = _changed(value, defaults[key])
        if value != defaults[key] and value != {}:
            out[key] = value
    return out


def sp_compute_loss(accelerator, model, inputs, return_outputs, pc):
    """Replaces ``transformers.trainer.deepspeed_sp_compute_loss`` (same signature).

    The model :func:`ds_ulysses.initialize` prepared returns, for the adapter's batch, the sample's
    global token-mean loss with its backward scaled for the engine's gradient reduction, so the loss
    is the model's own: exact under ZeRO-1, 2 and 3.
    """
    if "shift_labels" not in inputs:
        raise ValueError(
            f"Ulysses SP is on (parallelism_config sp_size={pc.sp_size}) but the training batch has no 'shift_labels' "
            f"(keys: {sorted(inputs)}): it did not come from UlyssesSPDataLoaderAdapter; expected the Trainer's train "
            "loader to be wrapped; fix: call ds_ulysses.install() before creating the Trainer, and do not replace "
            "the Trainer's train DataLoader after it is prepared")
    outputs = model(**inputs)
    if outputs.loss is None:
        raise RuntimeError(
            "the model returned no loss for the SP batch's shift_labels: ds_ulysses's SP loss is not on this model "
            "(its engine was built without ds_ulysses.initialize); expected ds_ulysses.install() to run before the "
            "Trainer (or Accelerator) was created; fix: call ds_ulysses.install() first")
    return (outputs.loss, outputs) if return_outputs else outputs.loss


def skip_first_batches(original, dataloader, num_batches=0):
    """Accelerate's ``skip_first_batches`` (``original``), able to resume into the SP adapter."""
    if isinstance(dataloader, UlyssesSPDataLoaderAdapter):
        return dataloader.resumed(num_batches, original)
    return original(dataloader, num_batches)


def activate_neftune(original, model, neftune_noise_alpha, accelerator=None):
    """Transformers' ``activate_neftune`` (``original``), with SP's alpha. NEFTune draws its noise from
    ``U(-m, m)``, ``m = alpha / sqrt(L * d)`` with ``L`` the length its embedding sees: a shard, ``1/sp`` of
    the sequence, under SP, so the noise would be ``sqrt(sp)`` times larger than without SP. ``alpha /
    sqrt(sp)`` gives the whole sequence's bound (its length padded to a multiple of sp)."""
    if _sp_on(accelerator):
        neftune_noise_alpha = neftune_noise_alpha / math.sqrt(accelerator.parallelism_config.sp_size)
    return original(model, neftune_noise_alpha, accelerator)


def _sp_on(accelerator) -> bool:
    pc = getattr(accelerator, "parallelism_config", None)
    return pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled


def _sp_training(trainer) -> bool:
    """Whether ``compute_loss`` takes the Trainer's SP branch (Transformers' own condition)."""
    return _sp_on(trainer.accelerator) and trainer.model.training


def refuse_dropped_loss_features(trainer) -> None:
    """Refuse the Trainer options its SP training loss would drop silently: the SP branch of
    ``Trainer.compute_loss`` returns before label smoothing or a ``compute_loss_func`` is applied."""
    if not _sp_on(trainer.accelerator):
        return
    sp = trainer.accelerator.parallelism_config.sp_size
    if trainer.label_smoother is not None:
        raise ValueError(
            f"Ulysses SP (sp_size={sp}) cannot serve label_smoothing_factor={trainer.args.label_smoothing_factor}: "
            "the Trainer's SP training loss is the model's token-mean cross-entropy over the whole sequence and "
            "would drop the smoothing silently; expected label_smoothing_factor=0; fix: set "
            "label_smoothing_factor=0, or train without sequence parallelism")
    if trainer.compute_loss_func is not None:
        raise ValueError(
            f"Ulysses SP (sp_size={sp}) cannot serve compute_loss_func={trainer.compute_loss_func!r}: the Trainer's "
            "SP training loss is the model's token-mean cross-entropy over the whole sequence (each rank holds a "
            "shard of it) and would never call the function; expected compute_loss_func=None; fix: drop "
            "compute_loss_func, or train without sequence parallelism")


def _weights_by_tokens(trainer) -> bool:
    """Whether the same Trainer without SP divides each micro-batch's loss sum by the step's token count
    (``num_items_in_batch``): Transformers' rule, a model whose forward takes loss kwargs. Under SP the
    Trainer sets ``model_accepts_loss_kwargs`` to False, so it is read from the model again here."""
    model = sys.modules["transformers.trainer"].unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def _mesh(trainer) -> Mesh | None:
    mpu = getattr(trainer.model_wrapped, "mpu", None)
    return mpu if isinstance(mpu, Mesh) else None


def step_tokens(trainer, batch_samples: list) -> int | None:
    """The optimizer step's labelled-token count, the divisor the Trainer without SP uses: this rank's
    shards of the accumulation window summed over every rank (``average_tokens_across_devices``, the
    default) or over the SP group (one DP replica's samples). None where the Trainer without SP
    averages micro-batch means instead, or when the batches are not the adapter's (the SP loss refuses them)."""
    mesh = _mesh(trainer)
    if mesh is None or not _weights_by_tokens(trainer) or any("shift_labels" not in b for b in batch_samples):
        return None
    local = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batch_samples)
    return all_reduce_sum(local, None if trainer.args.average_tokens_across_devices else mesh.sp_group)


def token_weight(trainer, inputs: dict, tokens_in_step: int) -> float:
    """What the micro-batch's SP loss (its own token mean) is multiplied by so that the step's gradient is
    the Trainer's without SP: ``micro-batch tokens / step tokens``, times the DP size when the divisor spans
    every replica (DeepSpeed averages the replicas' gradients, the Trainer without SP multiplies by the
    process count for that), times the accumulation steps the Trainer divides the SP loss by."""
    mesh = _mesh(trainer)
    tokens = all_reduce_sum(int((inputs["shift_labels"] != IGNORE_INDEX).sum()), mesh.sp_group)
    weight = tokens / max(tokens_in_step, 1)
    if trainer.args.average_tokens_across_devices:
        weight *= mesh.dp
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not True:
        weight *= trainer.current_gradient_accumulation_steps
    return weight


def _train(original, trainer, *args, **kwargs):
    """Under SP, training forwards are served inside ``Trainer.compute_loss`` only (:func:`_compute_loss`
    lifts the refusal): a subclass whose ``compute_loss`` never calls it computes its loss from shards."""
    refuse_dropped_loss_features(trainer)
    if not _sp_on(trainer.accelerator):
        return original(trainer, *args, **kwargs)
    serve_the_trainer_s_loss(trainer.accelerator)
    with unserved_loss_scope(type(trainer).compute_loss.__qualname__):
        return original(trainer, *args, **kwargs)


def _init_training_state(original, trainer, max_steps, num_update_steps_per_epoch, num_train_epochs,
                         resume_from_checkpoint, trial):
    """A resume whose DeepSpeed config has the "ulysses" section (set by either SP switch) has its data position
    checked before the engine is built (:func:`ds_ulysses.hf.resume.check_trainer_resume`)."""
    epochs, skipped = original(trainer, max_steps, num_update_steps_per_epoch, num_train_epochs,
                               resume_from_checkpoint, trial)
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and SECTION_KEY in plugin.deepspeed_config:
        check_trainer_resume(trainer, resume_from_checkpoint, skipped)
    return epochs, skipped


def _get_batch_samples(original, trainer, epoch_iterator, num_batches, device):
    """Only the training loop calls it, before the step's first ``training_step`` switches the model to
    train mode: a model fresh from ``from_pretrained`` is still in eval mode for the first step's
    batches, so SP is asked of the accelerator alone."""
    batch_samples, num_items_in_batch = original(trainer, epoch_iterator, num_batches, device)
    if _sp_on(trainer.accelerator):
        num_items_in_batch = step_tokens(trainer, batch_samples)
    return batch_samples, num_items_in_batch


def router_weight(trainer, fused_head: bool) -> float:
    """What the SP loss's router term (``coef * aux_loss``, one micro-batch's load-balancing loss) is
    multiplied by so that the step's gradient is the Trainer's without SP. The Trainer without SP leaves
    it inside the model's loss, times the process count (``average_tokens_across_devices``) and not divided
    over the accumulation steps; TRL's fused head divides it by the accumulation steps and leaves it out of
    the process count. Times the accumulation steps the Trainer divides the SP loss by."""
    if fused_head:
        weight = 1.0 / trainer.current_gradient_accumulation_steps
    else:
        weight = float(_mesh(trainer).dp) if trainer.args.average_tokens_across_devices else 1.0
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not True:
        weight *= trainer.current_gradient_accumulation_steps
    return weight


def _compute_loss(original, trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    with unserved_loss_scope(None):
        return _sp_loss(original, trainer, model, inputs, return_outputs, num_items_in_batch)


def _sp_loss(original, trainer, model, inputs, return_outputs, num_items_in_batch):
    if num_items_in_batch is None or not _sp_training(trainer):
        return original(trainer, model, inputs, return_outputs, num_items_in_batch)
    loss, outputs = original(trainer, model, inputs, True, num_items_in_batch)
    weight = token_weight(trainer, inputs, num_items_in_batch)
    aux = getattr(outputs, "aux_loss", None)
    if torch.is_tensor(aux):  # the SP loss added the router term: weighted apart from the token loss
        fused = bool(inputs.get("fused_lm_head"))
        router = router_coef(trainer.accelerator.unwrap_model(model), fused) * aux
        loss = (loss - router) * weight + router * router_weight(trainer, fused)
    else:
        loss = loss * weight
    return (loss, outputs) if return_outputs else loss


def _around(original, wrapper):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)
    return method


def _patch_trainer(tag: str) -> None:
    """The Trainer's SP loss, its token weighting, its refusals, NEFTune's bound, its resume skip and check, once
    ``transformers.trainer`` is imported."""
    trainer = sys.modules.get("transformers.trainer")
    if trainer is None or PATCHES.has(tag + ":trainer"):
        return
    PATCHES.set_attr(trainer, "deepspeed_sp_compute_loss", sp_compute_loss, tag + ":trainer")
    PATCHES.set_attr(trainer, "skip_first_batches", functools.partial(skip_first_batches, trainer.skip_first_batches),
                     tag + ":trainer")
    PATCHES.set_attr(trainer, "activate_neftune", functools.partial(activate_neftune, trainer.activate_neftune),
                     tag + ":trainer")
    for name, wrapper in (("train", _train), ("get_batch_samples", _get_batch_samples),
                          ("compute_loss", _compute_loss), ("_init_training_state", _init_training_state)):
        PATCHES.set_attr(trainer.Trainer, name, _around(getattr(trainer.Trainer, name), wrapper), tag + ":trainer")


def install_accelerate(tag: str) -> None:
    """Patch Accelerate (when installed) so every Accelerator built from now on is reconciled, and the
    Trainer module (now, or when the first Accelerator is built after it is imported)."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return
    original = Accelerator.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        reconcile(self)
        _patch_trainer(tag)

    PATCHES.set_attr(Accelerator, "__init__", __init__, tag)
    for name, wrapper in (("_prepare_deepspeed", prepare_deepspeed),
                          ("deepspeed_ulysses_dl_adapter", ulysses_dl_adapter)):
        PATCHES.set_attr(Accelerator, name, _around(getattr(Accelerator, name), wrapper), tag)
    _patch_trainer(tag)
