"""Transformers' Trainer, TRL's SFTTrainer and a plain Accelerate loop with a ring from the section alone: a tiny Llama with 2 query
heads and 1 KV head at sp 4 = Ulysses 2 x ring 2 on 4 gloo ranks (more SP ranks than heads), against one process
without SP (plain torch: the same model, samples and SGD steps; tests/support/trainer_cases.py).

After ``ds_ulysses.install()`` Accelerate registers SP and wraps the loaders through DeepSpeed's calls, which carry
no ring; the section's ring reaches both (:mod:`ds_ulysses.hf.accelerate_ring`). Each step's loss within 1e-5 and
the whole parameter update (``lr x`` the sum of the gradients) within 1e-4, the project's bar (Accelerate at ZeRO-1,
the Trainer at ZeRO-3); the Trainer's
evaluation (whole samples, SP off) gives the unsharded eval loss. Packed documents, which the ring does not serve,
are refused by name on every rank at the first forward. Once ``prepare`` is done, DeepSpeed's call registers no
ring again (the section's scope is undone).
"""

import functools

import pytest
import torch

from tests.support import trainer_cases as tc
from tests.support.distributed import run_distributed
from tests.support.models import rel_err, tiny_config, tiny_model

pytestmark = pytest.mark.slow

STEPS = 2
HEADS = (2, 1)
RING = {"ring_size": 2}


def _ring_runs(rank, world_size, out_dir):
    import ds_ulysses

    # first: Accelerate allows one Accelerator with a DeepSpeed plugin per process, and the Trainer resets its state;
    # ZeRO-1 there, since a ZeRO-3 plugin left behind would partition the Trainer's model as it is built
    accelerate = tc.accelerate_run(rank, world_size, 1, "section", STEPS, section_extra=RING, heads=HEADS)
    trainer = tc.trainer_run(rank, world_size, 3, "section", f"{out_dir}/trainer", STEPS, evaluate=True,
                             section_extra=RING, heads=HEADS)
    ds_ulysses.uninstall()
    try:
        tc.trainer_run(rank, world_size, 3, "section", f"{out_dir}/packed", 1, packed=True, section_extra=RING,
                       heads=HEADS)
        packed = None
    except ValueError as err:
        packed = str(err)
    ds_ulysses.uninstall()
    # the section's ring lasted as long as Accelerate's prepare: DeepSpeed's call alone registers no ring again
    try:
        ds_ulysses.UlyssesSPAttentionHF.register_with_transformers(
            tiny_model(tiny_config("llama", heads=HEADS[0], kv_heads=HEADS[1])), "sdpa", world_size, 1)
        after = None
    except ValueError as err:
        after = str(err)
    ds_ulysses.uninstall()
    return {"trainer": trainer, "accelerate": accelerate, "packed": packed, "after": after}


def test_the_trainer_and_accelerate_train_a_ring_exactly_and_refuse_packed_documents_on_every_rank(tmp_path):
    reference = tc.reference(tc.samples(2 * STEPS), STEPS, eval_data=tc.samples(4, seed=1), heads=HEADS)
    for res in run_distributed(_ring_runs, 4, str(tmp_path), timeout=900):
        for loop in ("trainer", "accelerate"):
            run = res[loop]
            assert (run["sp"], run["ring"]) == (4, 2), loop  # the engine's mesh: Ulysses 2 x ring 2
            errors = tc.compare(run, reference)
            assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, (loop, errors)
        assert res["accelerate"]["loader_ring"] == 2  # the loader Accelerate built in prepare lays samples out for it
        assert rel_err(torch.tensor(res["trainer"]["eval_loss"]), torch.tensor(reference["eval_loss"])) <= 1e-5
        assert res["packed"] is not None and "position_ids are not the head-tail block of one +1 run of positions " \
            "(packed documents" in res["packed"] and "fix: train on unpacked samples" in res["packed"]
        assert "fix: set ring_size to 2 (the smallest that works)" in res["after"]


def test_trl_s_sft_trainer_trains_a_ring_as_itself_without_sp(tmp_path):
    """TRL's SFTTrainer (its fused LM head, loss on completions only, 2 right-padded samples per micro-batch, 2
    micro-batches per step, ZeRO-1) at Ulysses 2 x ring 2 from the section, against the same SFTTrainer on one
    process without SP: it takes the Trainer's path."""
    run = functools.partial(tc.sft_trainer_run, heads=HEADS)
    (plain,) = run_distributed(run, 1, 1, str(tmp_path / "plain"), False, False, timeout=600)
    want = {"losses": plain["logged"], "start": plain["start"],
            "update": {n: plain["params"][n] - p for n, p in plain["start"].items()}}
    ring = functools.partial(tc.sft_trainer_run, ring=2, heads=HEADS)
    for res in run_distributed(ring, 4, 1, str(tmp_path / "ring"), True, False, timeout=600):
        errors = tc.compare({**res, "losses": res["logged"]}, want)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors
        assert abs(res["eval_loss"] - plain["eval_loss"]) <= 1e-5 * plain["eval_loss"]
