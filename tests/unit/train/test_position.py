"""Data positions across meshes, against an independent reference: the set of sample indices each
optimizer step trains, simulated rank by rank from the loader's rules (DistributedSampler without
shuffle, each SP group training its ranks' batches one micro-batch at a time)."""

import pytest

from ds_ulysses.train.checkpoint import CheckpointError
from ds_ulysses.train.position import (Layout, advance, continue_position, is_prefix, samples_needed,
                                       start_position)


def trained_per_step(layout: Layout, first: int, steps: int, skip: int = 0) -> list[set]:
    """Sample indices (from ``first``) each step trains: refill r gives rank k the samples
    ``first + r*W*mbs + k + j*W`` (j < mbs); micro-batch i of a refill is each SP group's i-th rank's."""
    W, mbs, sp = layout.world_size, layout.micro_batch, layout.sp
    micro = []  # micro-batches in training order, each the set of samples over the mesh
    refill = 0
    while len(micro) < skip + steps * layout.grad_accum:
        base = first + refill * W * mbs
        for i in range(sp):
            micro.append({base + (g * sp + i) + j * W for g in range(layout.dp) for j in range(mbs)})
        refill += 1
    micro = micro[skip:]
    return [set().union(*micro[s * layout.grad_accum:(s + 1) * layout.grad_accum]) for s in range(steps)]


LAYOUTS = [Layout(2, 2, 1, 2), Layout(2, 1, 1, 1), Layout(1, 1, 1, 2), Layout(4, 4, 1, 2), Layout(4, 2, 1, 1),
           Layout(2, 2, 1, 1)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_advance_and_prefix_match_the_simulated_loader(layout):
    held_out = 3
    every = trained_per_step(layout, held_out, 8)
    assert all(len(s) == layout.global_batch for s in every)
    for step in range(9):
        position = advance(start_position(layout, held_out), layout, step)
        done = set().union(*every[:step])
        assert position["samples_consumed"] == len(done) == step * layout.global_batch
        assert is_prefix(position, layout) == (done == set(range(held_out, held_out + len(done))))
        # resuming from the position reproduces the remaining steps
        later = trained_per_step(layout, position["sample_offset"], 8 - step, position["skip_micro_batches"])
        assert later == every[step:]
        assert samples_needed(position, layout, 8 - step) >= max(set().union(*every[step:]) or {0}) + 1


@pytest.mark.parametrize("saved_layout,layout", [(Layout(2, 2, 1, 2), Layout(2, 1, 1, 1)),
                                                 (Layout(2, 2, 1, 2), Layout(1, 1, 1, 2)),
                                                 (Layout(2, 2, 1, 2), Layout(4, 4, 1, 2)),
                                                 (Layout(1, 1, 1, 2), Layout(2, 2, 1, 2))], ids=str)
def test_another_mesh_with_the_same_global_batch_trains_what_an_uninterrupted_run_there_trains(saved_layout, layout):
    held_out, step = 2, 3
    saved = advance(start_position(saved_layout, held_out), saved_layout, step)
    position = continue_position(saved, saved_layout, layout)
    expected = trained_per_step(layout, held_out, 8)[step:]
    assert trained_per_step(layout, position["sample_offset"], 8 - step, position["skip_micro_batches"]) == expected
    assert advance(position, layout, 2)["samples_consumed"] == (step + 2) * layout.global_batch


def test_the_same_layout_takes_the_saved_position_even_mid_refill():
    layout = Layout(4, 2, 1, 1)  # dp 2: a refill left part way is not a prefix
    saved = advance(start_position(layout, 4), layout, 1)
    assert not is_prefix(saved, layout) and continue_position(saved, layout, layout) == saved


def test_changed_global_batch_is_refused_with_the_setting_that_keeps_it():
    saved_layout = Layout(2, 2, 1, 1)
    saved = advance(start_position(saved_layout, 2), saved_layout, 2)
    with pytest.raises(CheckpointError, match=r"global batch: the checkpoint trained 1 samples per step .* this job 2 "
                                              r".*fix: launch a mesh whose dp divides 1"):
        continue_position(saved, saved_layout, Layout(2, 1, 1, 1))
    with pytest.raises(CheckpointError, match=r"fix: choose train_micro_batch_size_per_gpu x "
                                              r"gradient_accumulation_steps = 2 for this mesh"):
        continue_position(start_position(Layout(1, 1, 1, 4), 0), Layout(1, 1, 1, 4), Layout(2, 1, 3, 1))
    with pytest.raises(CheckpointError, match="fix: set gradient_accumulation_steps to 2 for this mesh, or pass "
                                              "--allow-batch-change"):
        continue_position(advance(start_position(Layout(2, 2, 1, 2), 2), Layout(2, 2, 1, 2), 1),
                          Layout(2, 2, 1, 2), Layout(1, 1, 1, 1))
    new = continue_position(saved, saved_layout, Layout(2, 1, 1, 1), allow_batch_change=True)
    assert (new["sample_offset"], new["samples_consumed"], new["global_batch"]) == (4, 2, 2)


def test_a_position_that_is_not_a_prefix_is_refused_with_the_steps_that_are():
    saved_layout = Layout(4, 2, 1, 1)
    saved = advance(start_position(saved_layout, 4), saved_layout, 3)
    with pytest.raises(CheckpointError, match=r"data position: .* 1 micro-batches into a refill of 4 samples .* not a "
                                              r"prefix .*save at a step that is a multiple of 2"):
        continue_position(saved, saved_layout, Layout(2, 1, 1, 1))
