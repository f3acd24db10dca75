"""Where a run stands in its sample stream, and from where a job on another mesh continues it.

The stream: the first ``held_out`` samples are the evaluation's; training reads the rest in order.
Each rank's loader reads a distinct sample per refill (DistributedSampler, no shuffle) and its SP group
then trains on the ``sp`` samples of the refill one micro-batch at a time, so a refill consumes
``world * micro_batch`` consecutive samples and yields ``sp`` micro-batches; one micro-batch trains
``dp * micro_batch`` samples over the mesh and one optimizer step ``dp * micro_batch * grad_accum``,
the global batch. A position is where the refill in progress starts (``sample_offset``, held-out
samples included) and how many of its micro-batches were taken (``skip_micro_batches``).

Another mesh continues a run exactly when two things hold:

- the global batch is the same, so each later step averages the gradient of as many samples;
- the samples trained so far are the first ``samples_consumed`` of the stream (a *prefix*): the new
  mesh then starts a fresh refill right after them. A refill that was left part way holds trained and
  untrained samples interleaved unless one micro-batch trains one sample (``dp * micro_batch == 1``),
  so a checkpoint taken mid-refill on a wider mesh is not a prefix.

On the same mesh layout neither matters: the saved position is taken as it is (mid-refill included).
"""

from __future__ import annotations

import math

from ..reshard import CheckpointError, Layout, batch_fix, ranks

__all__ = ["ranks", "Layout", "start_position", "advance", "samples_needed", "is_prefix", "continue_position"]


def start_position(layout: Layout, held_out: int, consumed: int = 0) -> dict:
    """A fresh refill right after the first ``consumed`` training samples."""
    return {"sample_offset": held_out + consumed, "skip_micro_batches": 0, "held_out_samples": held_out,
            "gradient_accumulation_steps": layout.grad_accum, "micro_batch_size": layout.micro_batch,
            "samples_consumed": consumed, "global_batch": layout.global_batch}


def advance(position: dict, layout: Layout, steps: int) -> dict:
    """The position ``steps`` optimizer steps after ``position``."""
    micro = position["skip_micro_batches"] + steps * layout.grad_accum
    return {**position, "sample_offset": position["sample_offset"] + (micro // layout.sp) * layout.refill,
            "skip_micro_batches": micro % layout.sp,
            "samples_consumed": position["samples_consumed"] + steps * layout.global_batch}


def samples_needed(position: dict, layout: Layout, steps: int) -> int:
    """Samples of the stream, held-out ones included, that ``steps`` steps from ``position`` read."""
    micro = position["skip_micro_batches"] + steps * layout.grad_accum
    return position["sample_offset"] + math.ceil(micro / layout.sp) * layout.refill


def is_prefix(position: dict, layout: Layout) -> bool:
    """Whether the samples trained so far are exactly the first ``samples_consumed`` of the stream."""
    return layout.prefix_after(position["skip_micro_batches"])


def continue_position(saved: dict, saved_layout: Layout, layout: Layout, *, allow_batch_change: bool = False) -> dict:
    """Where a job of ``layout`` starts, resuming a checkpoint written at ``saved`` by ``saved_layout``.

    Raises :class:`CheckpointError` when no such position continues the run exactly: a changed global
    batch (unless ``allow_batch_change``, which trains on from the same samples as a new trajectory)
    or trained samples that are not a prefix of the stream.
    """
    if layout == saved_layout:
        return dict(saved)
    if saved["global_batch"] != layout.global_batch and not allow_batch_change:
        raise CheckpointError(
            f"global batch: the checkpoint trained {saved['global_batch']} samples per step "
            f"({saved_layout.describe()}), this job {layout.global_batch} ({layout.describe()}); a different "
            f"global batch is a different training run; fix: {batch_fix(saved['global_batch'], layout)}, or "
            "pass --allow-batch-change to train on from the checkpoint as a new trajectory")
    if not is_prefix(saved, saved_layout):
        every = saved_layout.sp // math.gcd(saved_layout.sp, saved_layout.grad_accum)
        raise CheckpointError(
            f"data position: the checkpoint stopped {saved['skip_micro_batches']} micro-batches into a refill of "
            f"{saved_layout.refill} samples on {saved_layout.describe()}, so the samples it trained are not a prefix "
            "of the stream and another mesh cannot continue without repeating or skipping some; fix: resume on "
            f"the checkpoint's mesh, save at a step that is a multiple of {every} (a refill boundary), and change "
            "the mesh from that checkpoint")
    return start_position(layout, saved["held_out_samples"], saved["samples_consumed"])
