"""The engine hook: ds_ulysses.initialize / install() against the unsharded model, every ZeRO stage.

Each run takes one step and compares (a) every rank's loss with its SP group's sample run
unsharded and (b) ``safe_get_full_grad`` with the mean of the DP groups' unsharded gradients.
DeepSpeed reduces gradients differently per stage (ZeRO-3's reduce-scatter averages over sp x dp,
the others divide by dp only); the loss contract must give the exact non-SP gradient on each path.
"""

import pytest
import torch

from ds_ulysses.engine import _sp_loader, loss_grad_scale
from ds_ulysses.distributed.mesh import Mesh

from tests.support.distributed import run_distributed
from tests.support.engine_cases import ds_config, engine_vs_reference, not_sp_inputs, trims_per_step

pytestmark = pytest.mark.slow


def _check(results, dp, sp):
    for res in results:
        assert (res["dp"], res["sp"]) == (dp, sp)
        assert res["loss"] <= 1e-5, res
        assert res["grad"] <= 1e-4, res


def test_zero3_cpu_offload_dp2_sp2():
    _check(run_distributed(engine_vs_reference, 4, ds_config(3, offload=True), timeout=600), 2, 2)


def test_one_process_world_trains_like_plain_deepspeed():
    # a 1-rank world still needs real groups: DeepSpeed broadcasts and reduces over the mpu's groups
    _check(run_distributed(engine_vs_reference, 1, ds_config(3, sp=1), timeout=600), 1, 1)


def test_install_makes_plain_deepspeed_initialize_honour_the_section():
    _check(run_distributed(engine_vs_reference, 4, ds_config(3, offload=True), True, timeout=600), 2, 2)


@pytest.mark.parametrize("stage,zero", [(0, {}), (1, {}), (2, {}), (3, {"reduce_scatter": False})])
def test_every_zero_stage_gives_non_sp_gradients(stage, zero):
    _check(run_distributed(engine_vs_reference, 2, ds_config(stage, **zero), timeout=600), 1, 2)


@pytest.mark.parametrize("switch,trims", [(None, 2), (True, 2), (False, 0)])
def test_host_heap_is_given_back_after_each_step_unless_switched_off(switch, trims):
    cfg = ds_config(3, offload=True, extra_section={} if switch is None else {"trim_host_heap": switch})
    assert run_distributed(trims_per_step, 2, cfg, timeout=600) == [trims, trims]


def test_mesh_param_argument_overrides_section():
    cfg = ds_config(2, sp=1)
    _check(run_distributed(engine_vs_reference, 4, cfg, False, "llama", 24, (2, 2), timeout=600), 2, 2)


def test_inputs_that_are_not_the_groups_shards_fail_on_every_rank_instead_of_training_plain_dp():
    for errors in run_distributed(not_sp_inputs, 2, timeout=600):
        assert errors["no_adapter"].startswith(
            "SP rank 0 (ranks [1] failed too): Ulysses SP is configured for this model, but its input did not come "
            "from UlyssesSPDataLoaderAdapter: no adapter has yielded shards for this SP group"), errors
        assert errors["not_a_shard"].startswith(
            "SP rank 0 (ranks [1] failed too): Ulysses SP is configured for this model, but its input_ids [1, 24] are "
            "not a shard UlyssesSPDataLoaderAdapter yielded for this SP group"), errors
        assert errors["misaligned"].startswith(
            "SP ranks run shards of different micro-batches: per SP rank the adapter's micro-batch [0, 1]"), errors


def test_train_batch_size_filled_for_plain_data_parallelism_is_resized_for_the_mesh():
    from ds_ulysses.engine import _fit_train_batch_size

    class FourRanksSp2:
        world_size, dp, sp = 4, 2, 2

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": 24}
    _fit_train_batch_size(config, FourRanksSp2)  # what Trainer/Accelerate fill in for 4 ranks of DP
    assert config["train_batch_size"] == 12
    config["train_batch_size"] = 7
    with pytest.raises(ValueError, match=r"train_batch_size=7 does not fit the SP mesh dp=2 x sp=2: expected "
                                         r"train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp = "
                                         r"2 x 3 x 2 = 12 .* fix: set train_batch_size to 12 or leave it out"):
        _fit_train_batch_size(config, FourRanksSp2)


def test_grad_scale_follows_the_reduction_path():
    assert loss_grad_scale({"zero_optimization": {"stage": 3}}, 4) == 4
    assert loss_grad_scale({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 4) == 1
    assert loss_grad_scale({"zero_optimization": {"stage": 2}}, 4) == 1
    assert loss_grad_scale({}, 4) == 1


def _consumed(rank, world_size):
    from ds_ulysses.config import UlyssesConfig

    mesh = Mesh(2, 2)
    data = [{"input_ids": torch.tensor([i, 100 + i, 200 + i, 300 + i]), "labels": torch.tensor([i] * 4)}
            for i in range(8)]
    loader = _sp_loader(data, mesh, UlyssesConfig(sequence_parallel_size=2), 1, None)
    epochs = []
    for _ in range(2):
        epochs.append([int(b["input_ids"][0, 0]) for b in loader] if mesh.sp_rank == 0 else len(list(loader)))
    return epochs


def test_each_sample_once_per_epoch_across_the_mesh():
    results = run_distributed(_consumed, 4)
    for epoch in range(2):
        seen = sorted(results[0][epoch] + results[2][epoch])  # SP rank 0 of each DP group sees token 0
        assert seen == list(range(8))
        assert results[1][epoch] == results[3][epoch] == 4


def _mpu_and_section(rank, world_size):
    import ds_ulysses

    from tests.support.models import tiny_config, tiny_model

    model = tiny_model(tiny_config("llama"))
    try:
        ds_ulysses.initialize(model=model, config=ds_config(2), mpu=object())
    except ValueError as err:
        first = str(err)
    try:
        ds_ulysses.initialize(model=model, config=ds_config(2), mesh_param=(3, 2))
    except ValueError as err:
        return first, str(err)
    return first, None


def _tiled_mlp_refusals(rank, world_size):
    """tiled_mlp on a model with nothing named ``mlp``, and on MLPs holding a ZeRO-3 leaf module."""
    import transformers
    from deepspeed.utils import set_z3_leaf_modules_by_name

    import ds_ulysses

    from tests.support.models import tiny_config, tiny_model

    section = {"tiled_mlp": {"enabled": True, "shards": 2}}
    errors = {}
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=64))
    for name, model, stage in [("no_mlp", opt, 3), ("leaf_inside", tiny_model(tiny_config("llama")), 3),
                               ("leaf_inside_zero2", tiny_model(tiny_config("llama")), 2)]:
        if name.startswith("leaf_inside"):
            set_z3_leaf_modules_by_name(model, ["model.layers.0.mlp.down_proj"])
        try:
            ds_ulysses.initialize(model=model, config=ds_config(stage, extra_section=section))
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
        ds_ulysses.uninstall()
    return errors


def test_tiled_mlp_that_would_tile_nothing_or_reduce_per_tile_is_refused():
    """A decoder without a module named ``mlp`` would train untiled with the switch on; a ZeRO-3 leaf module
    inside a tiled MLP would have its gradients reduced in every tile's recompute. ZeRO-2 has no leaf hooks."""
    for errors in run_distributed(_tiled_mlp_refusals, 2):
        assert "tiled_mlp is enabled but OPTForCausalLM's decoder has no module named 'mlp' to tile (its first " \
               "layer holds: self_attn" in errors["no_mlp"]
        assert '"tiled_mlp": {"enabled": false}' in errors["no_mlp"]
        assert "tiled_mlp cannot serve model.layers.0.mlp (LlamaMLP) under ZeRO-3: it holds the leaf module " \
               "down_proj (Linear)" in errors["leaf_inside"]
        assert '"leaf_module": {"classes": ["LlamaMLP"]}' in errors["leaf_inside"]
        assert errors["leaf_inside_zero2"] is None


def test_conflicting_wiring_is_refused_on_every_rank():
    for first, second in run_distributed(_mpu_and_section, 2):
        assert "got both an mpu (object) and a \"ulysses\" config section" in first
        assert second is not None and "dp=3 * sp=2 = 6 but world_size=2" in second


@pytest.mark.parametrize("stage,shards", [(3, 3), (2, "auto")])
def test_all_alst_switches_with_sp_match_unsharded(stage, shards):
    """SP 2 with tiled MLP, tiled fused logits loss and checkpoint offload on: still the exact maths."""
    section = {"tiled_mlp": {"enabled": True, "shards": shards}, "tiled_loss": {"enabled": True, "shards": shards},
               "activation_checkpoint_offload": {"enabled": True}}
    cfg = ds_config(stage, offload=stage == 3, extra_section=section)
    _check(run_distributed(engine_vs_reference, 2, cfg, timeout=600), 1, 2)
