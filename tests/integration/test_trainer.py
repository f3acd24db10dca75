"""Transformers' Trainer with Ulysses SP at sp 2 on 2 gloo ranks, from either switch, against one process
without SP (plain torch: the same model, samples and SGD steps; tests/support/trainer_cases.py).

- every ZeRO stage trains exactly: each step's loss (rel 1e-5) and the whole parameter update, i.e. the
  sum of the gradients (rel 1e-4); Transformers' own SP loss is 2x the gradient under ZeRO-1/2;
- ``trainer.evaluate()`` gives the unsharded eval loss (each rank evaluates whole samples, SP off);
- ``save_model`` under ZeRO-3 writes a model ``from_pretrained`` loads without SP or DeepSpeed;
- resume from a checkpoint, in a second Trainer of the same process, reproduces the run;
- a step of several micro-batches over DP replicas weights each labelled token as the Trainer without SP
  does (``num_items_in_batch``), for both values of ``average_tokens_across_devices``; packed SFT
  (Transformers' padding-free collator) trains as the same Trainer without SP, and so does a MoE model
  adding its router load-balancing loss;
- what used to train plain data parallelism silently (``install()`` after the Trainer exists) fails on
  every rank naming the missing piece; switches that disagree are refused naming both values, and so
  are label smoothing and ``compute_loss_func``, which the SP loss would drop.
"""

import functools

import pytest
import torch

from tests.support import trainer_cases as tc
from tests.support.distributed import run_distributed
from tests.support.models import rel_err, tiny_config, tiny_model

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return tc.reference(tc.samples(2 * STEPS), STEPS, eval_data=tc.samples(4, seed=1))


@pytest.mark.parametrize("stage,switch", [(1, "section"), (2, "parallelism_config"), (3, "both")])
def test_trainer_trains_evaluates_and_saves_like_one_process_without_sp(stage, switch, reference, tmp_path):
    save = stage == 3
    results = run_distributed(tc.trainer_run, 2, stage, switch, str(tmp_path), STEPS, True, save, timeout=600)
    for res in results:
        assert res["sp"] == 2
        errors = tc.compare(res, reference)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors
        assert rel_err(torch.tensor(res["eval_loss"]), torch.tensor(reference["eval_loss"])) <= 1e-5
        # parallelism_config alone: the section's defaults, the tiled loss (no logits) serving the Trainer's loss;
        # the sections here turn it off (tc.ds_config)
        assert res["logits"] == [switch != "parallelism_config"] * STEPS
    if save:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
        for name, param in saved.named_parameters():
            want = reference["start"][name] + reference["update"][name]
            assert rel_err(param.detach(), want) <= 1e-6, name


def test_tiled_attention_mlps_and_norms_under_checkpointing_train_like_one_process_without_sp(reference, tmp_path):
    """The section's tiled attention (each block a group of heads at a time), tiled MLPs and tiled norms (the blocks
    rebuilding the norms' outputs), inside the Trainer's gradient checkpointing (each group recomputed within the
    layer's recompute), ZeRO-3."""
    extra = {"tiled_attention": {"enabled": True}, "tiled_mlp": {"enabled": True, "shards": 2},
             "tiled_norms": {"enabled": True}}
    run = functools.partial(tc.trainer_run, section_extra=extra, checkpointing=True)
    for res in run_distributed(run, 2, 3, "section", str(tmp_path), STEPS, timeout=600):
        assert res["tiled_blocks"] == 2  # both layers' attention blocks ran tiled
        errors = tc.compare(res, reference)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors


def test_resume_in_a_second_trainer_reproduces_the_run(tmp_path):
    for res in run_distributed(tc.trainer_resume, 2, 2, str(tmp_path), timeout=900):
        whole, resumed = res["whole"], res["resumed"]
        assert len(whole["losses"]) == 4 and len(resumed["losses"]) == 2  # steps 3 and 4 again
        assert rel_err(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][2:])) <= 1e-6
        for name, param in whole["params"].items():
            assert rel_err(resumed["params"][name], param) <= 1e-6, name


def test_a_step_weights_tokens_over_micro_batches_and_replicas_as_the_trainer_without_sp(tmp_path):
    """dp 2 x sp 2 on 4 ranks, 2 micro-batches per step, samples whose -100 prompts differ in length: the
    Trainer without SP divides the step's summed loss by its labelled tokens (over every replica with
    ``average_tokens_across_devices``, else over each replica's, averaging the replicas). Under SP the
    adapter deals each replica 2 consecutive samples of the step's 4."""
    data = tc.samples(16, prompts=True)
    want = {True: tc.reference(data, 2, window=4), False: tc.reference(data, 2, window=4, groups=2)}
    sample_means = tc.reference(data, 2, window=4, groups=4)  # what Transformers' SP path trains
    for res in run_distributed(tc.trainer_token_weighting, 4, str(tmp_path), timeout=600):
        for average, run in res.items():
            logged = {**run, "losses": run["logged"]}
            errors = tc.compare(logged, want[average])
            assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, (average, errors)
            assert tc.compare(logged, sample_means)["update"] > 0.1  # the prompts make the weighting matter


def test_packed_sft_trains_as_the_same_trainer_without_sp(tmp_path):
    """Padding-free packing (Transformers' DataCollatorWithFlattening: 3 documents with -100 prompts per
    micro-batch, position_ids restarting per document), 2 micro-batches per step, ZeRO-3: the Trainer at
    sp 2 against the same Trainer on one process without SP, which attends within each document and
    divides the step by its labelled tokens."""
    (plain,) = run_distributed(tc.trainer_packed, 1, "none", str(tmp_path / "plain"), timeout=600)
    start = {n: p.detach() for n, p in tiny_model(tiny_config("llama", heads=4, kv_heads=2)).named_parameters()}
    want = {"losses": plain["logged"], "start": start, "update": {n: plain["params"][n] - p for n, p in start.items()}}
    for res in run_distributed(tc.trainer_packed, 2, "section", str(tmp_path / "sp"), timeout=600):
        assert res["sp"] == 2 and len(res["logged"]) == 2
        errors = tc.compare({**res, "losses": res["logged"]}, want)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors


def test_a_moe_router_loss_trains_as_the_same_trainer_without_sp(tmp_path):
    """Mixtral adding its router load-balancing loss (weight 0.5) at dp 2 x sp 2, 2 micro-batches per step of
    samples with -100 prompts, ZeRO-3, against the same Trainer at dp 2 without SP. Without SP the Trainer
    divides the token loss by the step's tokens but leaves each micro-batch's router loss whole, times the
    process count; under SP the router loss is the whole sequence's and weighted the same way."""
    start = {n: p.detach() for n, p in tc.moe_model().named_parameters()}
    plain = run_distributed(tc.trainer_router_loss, 2, "none", str(tmp_path / "plain"), timeout=600)[0]
    want = {"losses": plain["logged"], "start": start, "update": {n: plain["params"][n] - p for n, p in start.items()}}
    for res in run_distributed(tc.trainer_router_loss, 4, "section", str(tmp_path / "sp"), timeout=600):
        assert res["sp"] == 2 and len(res["logged"]) == 2
        errors = tc.compare({**res, "losses": res["logged"]}, want)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors


def test_sp_that_cannot_run_fails_on_every_rank_naming_the_missing_piece(tmp_path):
    for errors in run_distributed(tc.trainer_refusals, 2, str(tmp_path), timeout=600):
        assert "Ulysses SP is configured for this model, but its input did not come from " \
               "UlyssesSPDataLoaderAdapter" in errors["install_after_trainer"]
        assert "(ranks [1] failed too)" in errors["install_after_trainer"]
        assert ("Accelerate's parallelism_config has sp_handler.sp_attn_implementation='flash_attention_2' but the "
                "DeepSpeed config's \"ulysses\" section has attn_implementation='sdpa'") \
            in errors["disagreeing_switches"]
        assert "cannot serve label_smoothing_factor=0.1" in errors["label_smoothing"]
        assert "cannot serve compute_loss_func=" in errors["compute_loss_func"]
        assert ("cannot serve trainer_refusals.<locals>.ShardMeanLoss.compute_loss: it computes its training loss "
                "without Trainer.compute_loss") in errors["own_compute_loss"]
