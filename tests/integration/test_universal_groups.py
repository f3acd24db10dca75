"""DeepSpeed's ZeRO-3 universal load with two parameter groups, and :func:`restore_param_groups`.

Two groups with different hyperparameters (weight decay 0.5 and 0.0, as HF Trainer's decay /
no-decay split) train 4 steps on 2 gloo ranks, are saved as HF Trainer saves (``global_step4`` named by
``latest``), converted by ``ds-ulysses universal`` (``global_step4_universal`` named by
``latest_universal``) and loaded on one rank by DeepSpeed's ``load_checkpoint(dir)`` without a tag, as
the Trainer calls it. The reference is an uninterrupted run of 8 steps on one rank with the same global batch
(2 samples: one per rank there, one micro-batch of both here; ZeRO averages over the ranks).

Pinned: DeepSpeed's own load gives group 1 group 0's weight decay and one step tensor shared by both
groups (these asserts fail once DeepSpeed fixes its load; then the repair can go); after the repair
steps 5-8 equal the reference within 1e-6 relative (only the reduction order of steps 1-4 differs:
all-reduce of 2 ranks vs one batch), while the unrepaired run drifts by more than 1e-5.
"""

from pathlib import Path

import pytest
import torch

from tests.support.distributed import run_distributed

pytestmark = pytest.mark.slow

STEPS, SAVED = 8, 4
DECAY = (0.5, 0.0)


def _engine(load_universal=False):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": DECAY[0]}, {"params": biases, "weight_decay": DECAY[1]}]
    optimizer = torch.optim.AdamW(groups, lr=5e-2)
    config = {"train_micro_batch_size_per_gpu": 2 // torch.distributed.get_world_size(),
              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
              "checkpoint": {"load_universal": load_universal}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine, step):
    """One optimizer step on the global batch of ``step`` (2 samples), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    share = slice(rank * 2 // world, (rank + 1) * 2 // world)
    loss = torch.nn.functional.mse_loss(engine(x[share]), y[share])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / world


def _save(rank, world_size, directory):
    engine = _engine()
    for step in range(1, SAVED + 1):
        _step(engine, step)
    engine.save_checkpoint(directory, tag=f"global_step{SAVED}")


def _state(engine):
    zero = engine.optimizer
    base = zero.optimizer
    steps = [base.state[flat]["step"] for flat in zero.fp32_partitioned_groups_flat]
    return [g["weight_decay"] for g in base.param_groups], steps


def _one_rank(rank, world_size, directory):
    from ds_ulysses.train.universal import restore_param_groups

    reference = _engine()
    expected = {step: _step(reference, step) for step in range(1, STEPS + 1)}
    results = {"expected": expected}
    for repaired in (False, True):
        engine = _engine(load_universal=True)
        engine.load_checkpoint(directory)
        decay, steps = _state(engine)
        raw = {"decay": decay, "shared_step": steps[0] is steps[1]}
        if repaired:
            assert restore_param_groups(engine, Path(directory) / f"global_step{SAVED}_universal") == 2
        decay, steps = _state(engine)
        losses = {step: _step(engine, step) for step in range(SAVED + 1, STEPS + 1)}
        results[repaired] = {"raw": raw, "decay": decay, "steps": [float(s) for s in _state(engine)[1]],
                             "losses": losses}
    return results


def test_restore_param_groups_repairs_deepspeeds_zero3_universal_load(tmp_path):
    from ds_ulysses.cli import main

    run_distributed(_save, 2, str(tmp_path), timeout=600)
    assert main(["universal", str(tmp_path)]) == 0
    res = run_distributed(_one_rank, 1, str(tmp_path), timeout=600)[0]
    expected = res["expected"]
    for repaired in (False, True):  # DeepSpeed's own load, before any repair: the defects this works around
        assert res[repaired]["raw"] == {"decay": [DECAY[0], DECAY[0]], "shared_step": True}
    fixed, broken = res[True], res[False]
    assert fixed["decay"] == list(DECAY) and fixed["steps"] == [float(STEPS), float(STEPS)]
    assert broken["steps"] == [float(SAVED + 2 * (STEPS - SAVED))] * 2  # one tensor, stepped once per group
    for step, loss in fixed["losses"].items():
        assert abs(loss - expected[step]) <= 1e-6 * abs(expected[step]), (step, loss, expected[step])
    drift = max(abs(loss - expected[step]) / abs(expected[step]) for step, loss in broken["losses"].items())
    assert drift > 1e-5, drift
