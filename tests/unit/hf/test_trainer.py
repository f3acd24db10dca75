"""The two SP switches made one: the "ulysses" section and Accelerate's parallelism_config, merged or refused;
the Trainer's pieces that see one rank's shard (NEFTune's bound) and its resume skip."""

import types

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig

from ds_ulysses.config import UlyssesConfig
from ds_ulysses.hf.trainer import (_changed, _merge, _parallelism_config, activate_neftune, reconcile,
                                   serve_the_trainer_s_loss, skip_first_batches, sp_compute_loss)
from ds_ulysses.sp.data import UlyssesSPDataLoaderAdapter
from tests.support.models import tiny_config, tiny_model


def _pc(sp=2, **handler):
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp,
                             sp_handler=DeepSpeedSequenceParallelConfig(**handler) if handler else None)


def test_a_section_alone_gives_the_equivalent_parallelism_config():
    section = UlyssesConfig(sequence_parallel_size=2, attn_implementation="flash_attention_2")
    pc = _parallelism_config(_merge(section, None), None, world_size=8)
    assert (pc.sp_size, pc.sp_backend, pc.data_parallel_size) == (2, "deepspeed", 4)  # Accelerate's batch arithmetic
    assert pc.sp_handler.sp_attn_implementation == "flash_attention_2"
    assert pc.sp_handler.sp_seq_length_is_variable and pc.sp_handler.sp_seq_length is None


def test_a_parallelism_config_alone_gives_the_equivalent_section():
    section = _merge(None, _pc(4, sp_attn_implementation="sdpa", sp_seq_length_is_variable=False, sp_seq_length=64))
    assert section == UlyssesConfig(sequence_parallel_size=4, attn_implementation="sdpa", seq_length_is_variable=False,
                                    seq_length=64, disable_in_eval=True)
    # Transformers' documented path leaves the dp sizes at 1: Accelerate would size DeepSpeed's batch for dp 1
    assert _parallelism_config(section, _pc(4), world_size=8).data_parallel_size == 2


def test_agreeing_switches_merge_and_the_section_keeps_its_other_fields():
    section = UlyssesConfig(sequence_parallel_size=2, tiled_mlp={"enabled": True}, disable_in_eval=False)
    merged = _merge(section, _pc(2, sp_attn_implementation="sdpa"))
    assert merged.tiled_mlp.enabled and merged.disable_in_eval  # under Accelerate, evaluation runs without SP
    assert _merge(section, ParallelismConfig()) == merged  # a parallelism_config without SP adds nothing


@pytest.mark.parametrize("pc,message", [
    (_pc(4), "parallelism_config has sp_size=4 but the DeepSpeed config's \"ulysses\" section has "
             "sequence_parallel_size=2"),
    (_pc(2, sp_attn_implementation="flash_attention_2"),
     "parallelism_config has sp_handler.sp_attn_implementation='flash_attention_2' but the DeepSpeed config's "
     "\"ulysses\" section has attn_implementation='sdpa'"),
    (_pc(2, sp_seq_length_is_variable=False, sp_seq_length=32),
     "parallelism_config has sp_handler.sp_seq_length_is_variable=False but the DeepSpeed config's \"ulysses\" "
     "section has seq_length_is_variable=True"),
])
def test_disagreeing_switches_are_refused_naming_both_values(pc, message):
    with pytest.raises(ValueError, match="fix: make them equal, or give only one") as err:
        _merge(UlyssesConfig(sequence_parallel_size=2), pc)
    assert message in str(err.value)


def test_a_data_parallel_size_that_does_not_tile_the_world_is_refused():
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2, dp_replicate_size=3)
    with pytest.raises(ValueError, match=r"data-parallel size of 3 .* but 8 ranks at sp=2 give dp=4; .* "
                                         r"fix: set dp_shard_size=4"):
        _parallelism_config(UlyssesConfig(sequence_parallel_size=2), pc, world_size=8)


def test_the_section_handed_to_accelerate_has_no_auto_values():
    # Accelerate fills in or rejects every "auto" in its DeepSpeed config; "auto" is only ever our default
    section = UlyssesConfig(sequence_parallel_size=2, tiled_loss={"enabled": False}, disable_in_eval=True)
    assert _changed(section.to_dict(), UlyssesConfig().to_dict()) == {
        "sequence_parallel_size": 2, "tiled_loss": {"enabled": False}, "disable_in_eval": True}


class _Accelerator:
    """What ``reconcile`` reads of an Accelerator (given as attributes)."""


def _reconciled(config: dict, pc, sp: int = 2) -> tuple:
    """An Accelerator with this DeepSpeed config and parallelism_config (4 processes, no process group) after
    ``reconcile``, and the section it left in the config."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    hf_ds_config = HfDeepSpeedConfig(config)
    plugin = types.SimpleNamespace(hf_ds_config=hf_ds_config, deepspeed_config=hf_ds_config.config)
    accelerator = _Accelerator()
    accelerator.state = types.SimpleNamespace(deepspeed_plugin=plugin, parallelism_config=pc)
    accelerator.num_processes = 4
    reconcile(accelerator)
    assert accelerator.state.parallelism_config.sp_size == sp
    return accelerator, plugin.deepspeed_config["ulysses"]


def test_parallelism_config_alone_gives_deepspeed_s_outputs_in_a_user_s_loop_and_our_loss_in_the_trainer():
    # the user's own loop, written for DeepSpeed's SP path, takes its loss from model(**batch).logits: the model
    # returns logits and no loss, and the engine steps without the heap trim, as under DeepSpeed's module
    accelerator, section = _reconciled({"zero_optimization": {"stage": 3}}, _pc(2))
    assert section == {"sequence_parallel_size": 2, "model_loss": False, "tiled_loss": {"enabled": False},
                       "trim_host_heap": False, "disable_in_eval": True}
    # the Trainer computes its loss from the model's (nothing reads the logits): the defaults, tiled loss and trim on
    serve_the_trainer_s_loss(accelerator)
    assert section == {"sequence_parallel_size": 2, "disable_in_eval": True}
    # a section given is the user's choice in either loop
    accelerator, section = _reconciled({"ulysses": {"sequence_parallel_size": 2, "tiled_loss": {"enabled": False}}},
                                       _pc(2))
    serve_the_trainer_s_loss(accelerator)
    assert section == {"sequence_parallel_size": 2, "tiled_loss": {"enabled": False}, "disable_in_eval": True}
    # but the Trainer cannot train on a model that computes no loss
    accelerator, section = _reconciled({"ulysses": {"sequence_parallel_size": 2, "model_loss": False,
                                                    "tiled_loss": {"enabled": False}}}, _pc(2))
    with pytest.raises(ValueError, match="model_loss false, but Transformers' Trainer computes its SP loss from the "
                                         "model's .* fix: drop model_loss from the section"):
        serve_the_trainer_s_loss(accelerator)


def test_a_ring_reaches_accelerate_and_a_ring_with_another_core_is_refused_by_name():
    accelerator, section = _reconciled({"ulysses": {"sequence_parallel_size": 4, "ring_size": 2}}, _pc(4), sp=4)
    assert section["ring_size"] == 2  # read back by ds_ulysses.initialize and Accelerate's registration
    with pytest.raises(ValueError, match=r"ring_size=2 needs attn_implementation 'sdpa', got 'flash_attention_2'.*"
                                         r"fix: set attn_implementation to \"sdpa\", or ring_size to 1"):
        _reconciled({"ulysses": {"sequence_parallel_size": 4, "ring_size": 2,
                                 "attn_implementation": "flash_attention_2"}}, _pc(4), sp=4)


class _Outputs:
    def __init__(self, loss):
        self.loss = loss


def test_the_trainer_loss_is_the_model_s_and_names_what_is_missing():
    pc = _pc(2)
    assert sp_compute_loss(None, lambda **batch: _Outputs(1.5), {"shift_labels": 0}, False, pc) == 1.5
    with pytest.raises(ValueError, match="the training batch has no 'shift_labels' .* fix: call ds_ulysses.install"):
        sp_compute_loss(None, lambda **batch: _Outputs(1.5), {"labels": 0}, False, pc)
    with pytest.raises(RuntimeError, match="ds_ulysses's SP loss is not on this model .* fix: call ds_ulysses.install"):
        sp_compute_loss(None, lambda **batch: _Outputs(None), {"shift_labels": 0}, False, pc)


def test_resume_skips_into_the_adapter_and_leaves_other_loaders_to_accelerate():
    calls = []
    assert skip_first_batches(lambda dl, n: calls.append((dl, n)) or "skipped", "loader", 3) == "skipped"
    adapter = UlyssesSPDataLoaderAdapter([{"input_ids": torch.ones(1, 4, dtype=torch.long)}], 0, None, 1, "cpu")
    resumed = skip_first_batches(lambda dl, n: dl[n:], adapter, 1)
    assert isinstance(resumed, UlyssesSPDataLoaderAdapter) and list(resumed) == []


@pytest.mark.parametrize("sp", [2, 4])
def test_neftune_bounds_a_shard_s_noise_by_the_whole_sequence_as_without_sp(sp):
    """NEFTune adds U(-m, m) noise to the embeddings, m = alpha / sqrt(L * d) for L tokens of width d. Under SP
    its hook sees a shard of L / sp tokens: Transformers' m is sqrt(sp) too large there, ours is the whole
    sequence's (the noise's largest entry, over a shard's L / sp x d >= 512 draws, lies within 5% of m:
    below 0.95 m with probability 0.95^512 < 1e-11)."""
    from transformers.integrations.neftune import activate_neftune as transformers_activate

    length, alpha = 64, 5.0
    accelerator = types.SimpleNamespace(
        unwrap_model=lambda m: m, parallelism_config=types.SimpleNamespace(sp_backend="deepspeed", sp_enabled=True,
                                                                           sp_size=sp))
    ids = torch.randint(0, 64, (1, length // sp), generator=torch.Generator().manual_seed(0))
    biggest = {}
    for name, activate in (("ours", lambda *a: activate_neftune(transformers_activate, *a)),
                           ("transformers", transformers_activate)):
        model = tiny_model(tiny_config("llama")).train()
        embed = model.get_input_embeddings()
        handle = activate(model, alpha, accelerator)
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(0)
            biggest[name] = (embed(ids) - embed.weight[ids]).abs().max().item()
        handle.remove()
    bound = alpha / (length * embed.embedding_dim) ** 0.5
    assert 0.95 * bound <= biggest["ours"] <= bound
    assert biggest["transformers"] > 0.95 * sp ** 0.5 * bound


def test_install_points_accelerate_and_the_trainer_at_ds_ulysses_and_uninstall_restores_them():
    import deepspeed
    import transformers.trainer as trainer_module
    from accelerate import Accelerator
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    import ds_ulysses

    def current():
        return (deepspeed.initialize, ulysses_sp.UlyssesSPAttentionHF, ulysses_sp.UlyssesSPDataLoaderAdapter,
                Accelerator.__init__, trainer_module.deepspeed_sp_compute_loss, trainer_module.skip_first_batches,
                trainer_module.Trainer.train, trainer_module.Trainer.get_batch_samples,
                trainer_module.Trainer.compute_loss, trainer_module.activate_neftune)

    before = current()
    ds_ulysses.install()
    ds_ulysses.install()  # idempotent
    assert ulysses_sp.UlyssesSPAttentionHF is ds_ulysses.UlyssesSPAttentionHF
    assert ulysses_sp.UlyssesSPDataLoaderAdapter is ds_ulysses.UlyssesSPDataLoaderAdapter
    assert trainer_module.deepspeed_sp_compute_loss is sp_compute_loss
    assert all(now is not then for now, then in zip(current(), before))
    ds_ulysses.uninstall()
    assert all(now is then for now, then in zip(current(), before))
