"""The Trainer's ``resume_from_checkpoint`` on another mesh: its data position checked before any step.

The engine hook loads a checkpoint of any world size (:func:`ds_ulysses.reshard.load_on_any_mesh`); what
it cannot see is the data. The Trainer resumes its data by skipping, at this job's mesh, as many
micro-batches as this job would have trained in the epoch so far (``steps x
gradient_accumulation_steps``). That continues the checkpoint's run exactly only when

- the global batch (``dp x per_device_train_batch_size x gradient_accumulation_steps``) is the
  checkpoint's: each later step then averages the gradient of as many samples, and the skipped
  micro-batches hold as many samples as were trained;
- the samples the checkpoint trained, and the ones this job skips, are the first of the epoch's order
  (:meth:`ds_ulysses.reshard.Layout.prefix_after`): a refill left part way holds trained and untrained
  samples interleaved unless one micro-batch trains one sample.

Anything else is refused before the engine is built (so before any conversion and any step), naming
the setting that keeps the run, or ``ignore_data_skip=True``, the Trainer's own opt-out (it then
starts the epoch's data over, with the checkpoint's weights and optimizer: a new trajectory).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..reshard import CheckpointError, Layout, batch_fix, saved_layout

__all__ = ["check_resume_data", "check_trainer_resume"]


def _checkpoint_tag_dir(checkpoint: Path) -> Path | None:
    latest = checkpoint / "latest"
    return checkpoint / latest.read_text().strip() if latest.is_file() else None


def check_resume_data(checkpoint, layout: Layout, steps_in_epoch: int) -> None:
    """Raise :class:`CheckpointError` unless skipping ``steps_in_epoch`` steps of ``layout``'s data
    continues the run that wrote ``checkpoint`` (a Trainer ``checkpoint-N`` directory) exactly."""
    checkpoint = Path(checkpoint)
    tag_dir = _checkpoint_tag_dir(checkpoint)
    if tag_dir is None:  # not a DeepSpeed checkpoint: the Trainer's own load says so
        return
    saved = saved_layout(tag_dir)
    if saved == layout:
        return
    opt_out = ("or set ignore_data_skip=True in TrainingArguments to train on from the checkpoint's weights and "
               "optimizer with the data started over (a new trajectory)")
    if saved.global_batch != layout.global_batch:
        raise CheckpointError(
            f"global batch: the checkpoint {checkpoint} trained {saved.global_batch} samples per step "
            f"({saved.describe()}), this job {layout.global_batch} ({layout.describe()}); a different global batch "
            f"is a different training run, and the Trainer would skip the wrong samples; fix: "
            f"{batch_fix(saved.global_batch, layout)}, {opt_out}")
    for who, at in (("the checkpoint", saved), ("this job", layout)):
        if not at.prefix_after(steps_in_epoch * at.grad_accum):
            every = at.sp // math.gcd(at.sp, at.grad_accum)
            raise CheckpointError(
                f"data position: {who} ({at.describe()}) stops {steps_in_epoch} steps into the epoch, part way into "
                f"a refill of {at.refill} samples, so the samples trained before the checkpoint are not the ones "
                f"this job skips; fix: resume on the checkpoint's mesh, or from a checkpoint whose step within the "
                f"epoch is a multiple of {every} (save_steps), {opt_out}")


def check_trainer_resume(trainer, checkpoint, skipped_micro_batches: int) -> None:
    """:func:`check_resume_data` for a Trainer under SP that resumes ``checkpoint`` and skips
    ``skipped_micro_batches`` (what ``Trainer._init_training_state`` returned) unless ``ignore_data_skip``."""
    args = trainer.args
    if checkpoint is None or args.ignore_data_skip or trainer.state.global_step == 0:
        return
    pc = trainer.accelerator.parallelism_config
    layout = Layout(trainer.accelerator.num_processes, pc.sp_size if pc is not None else 1,
                    args.per_device_train_batch_size, args.gradient_accumulation_steps)
    check_resume_data(checkpoint, layout, skipped_micro_batches // args.gradient_accumulation_steps)
