"""Reliability: every bad input a clear error on every rank, unservable models refused, a dead or
stalled rank an error naming the SP group and the step, and properties of the adapter.

Multi-rank cases run several scenarios in one process group: each scenario must raise at the same
point on every rank, so the group stays in step for the next one (a rank that did not raise would
hang the next scenario, and ``run_distributed``'s timeout turns that into a failure). Rank
functions return plain strings and numbers only.
"""

import copy
import datetime
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, build_mesh, unregister_from_transformers
from ds_ulysses.config import UlyssesConfig, UlyssesConfigError, load_schema
from ds_ulysses.data import prepare_sample
from ds_ulysses.loss import enable_sp_loss, sp_loss_from_logits, tiled_causal_lm_loss
from ds_ulysses.validate import check_batch, check_mesh_param, check_model_servable
from ds_ulysses.watch import GroupWatch, SPCommError

from .distributed import free_port, run_distributed
from .models import VOCAB, rel_err, tiny_config, tiny_model
from .sp_cases import make_sample, reference_loss

REPO = Path(__file__).resolve().parent.parent
SCENARIO_TIMEOUT = 60  # a scenario that fails on one rank only surfaces as SPCommError, not a hang


def _ids(*shape, high=VOCAB):
    return torch.randint(0, high, shape)


def _run_scenarios(rank, world_size, names):
    """Each named scenario on this rank; its error message (or 'NO ERROR') by name."""
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=SCENARIO_TIMEOUT))
    out = {}
    for name in names:
        try:
            SCENARIOS[name][0](rank, group)
            out[name] = "NO ERROR"
        except Exception as err:  # the message is what the test checks
            out[name] = f"{type(err).__name__}: {err}"
    return out


# ---------------------------------------------------------------- batches, one rank

def _batch(**over):
    batch = {"input_ids": _ids(2, 6), "labels": _ids(2, 6), "position_ids": torch.arange(6).expand(2, 6).clone()}
    batch.update(over)
    return {k: v for k, v in batch.items() if v is not None}


BAD_BATCHES = [
    ("not a dict", [torch.ones(2, 6)], "each batch must be a dict of tensors"),
    ("non-str key", {**_batch(), 3: torch.ones(2, 6)}, "batch keys must be strings, got 3"),
    ("3-d input_ids", _batch(input_ids=torch.ones(2, 6, 1, dtype=torch.long)),
     r"needs a tensor 'input_ids' of shape \[bs, sl\]; got shape \[2, 6, 1\]"),
    ("float input_ids", _batch(input_ids=torch.ones(2, 6)), "'input_ids' must be an integer tensor, got torch.float32"),
    ("empty sequence", _batch(input_ids=torch.ones(2, 0, dtype=torch.long), labels=None, position_ids=None),
     "input_ids is empty"),
    ("batch dim mismatch", _batch(labels=_ids(1, 6)),
     r"must share the batch size on dim 0.*'labels' has shape \[1, 6\]"),
    ("labels and shift_labels", _batch(shift_labels=_ids(2, 6)), "both 'labels' and 'shift_labels'"),
    ("token id >= vocab", _batch(input_ids=torch.full((2, 6), VOCAB)),
     rf"'input_ids' has a value out of range: expected \[0, {VOCAB}\), got {VOCAB}"),
    ("negative token id", _batch(input_ids=torch.full((2, 6), -1)), "'input_ids' has a value out of range"),
    ("label >= vocab", _batch(labels=torch.full((2, 6), 500)),
     rf"'labels' has a value out of range: expected -100 or \[0, {VOCAB}\), got 500"),
    ("label -5", _batch(labels=torch.full((2, 6), -5)), "'labels' has a value out of range.*got -5"),
    ("float labels", _batch(labels=torch.zeros(2, 6)), "'labels' must be an integer tensor"),
    ("3-d position_ids", _batch(position_ids=torch.zeros(2, 6, 1, dtype=torch.long)),
     r"position_ids must have shape \[bs, sl\] or \[1, sl\] = \[2, 6\] or \[1, 6\]; got \[2, 6, 1\]"),
    ("float position_ids", _batch(position_ids=torch.zeros(2, 6)), "'position_ids' must be an integer tensor"),
    ("negative position_ids", _batch(position_ids=torch.full((2, 6), -3)),
     "'position_ids' has a value out of range: expected >= 0, got -3"),
    ("left padding", _batch(attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)),
     "attention_mask has padding before real tokens"),
]


@pytest.mark.parametrize("batch,phrase", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_is_refused_with_its_reason(batch, phrase):
    with pytest.raises(ValueError, match=phrase):
        check_batch(batch, VOCAB)
    if isinstance(batch, dict) and 3 not in batch:
        with pytest.raises(ValueError, match=phrase):  # the adapter's entry point says the same
            prepare_sample(batch, 2, vocab_size=VOCAB)


def test_right_padding_and_broadcast_positions_are_accepted():
    check_batch(_batch(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]),
                       position_ids=torch.arange(6)[None]), VOCAB)


@pytest.mark.parametrize("value", [[2], "22", [0, 2], [True, 1], (2, 2.0), None])
def test_bad_mesh_param_is_refused(value):
    with pytest.raises(ValueError, match=r"mesh_param: expected \[dp, sp\], two integers >= 1"):
        check_mesh_param(value)
    if value is not None:
        with pytest.raises(ValueError, match=r"mesh_param: expected \[dp, sp\]"):
            build_mesh(mesh_param=value)


def test_labels_out_of_vocab_in_the_loss_name_the_count_and_the_vocabulary():
    logits = torch.randn(1, 4, VOCAB)
    with pytest.raises(ValueError, match=rf"shift_labels out of range: 2 label\(s\) in this batch are neither "
                                         rf"-100 nor in \[0, {VOCAB}\)"):
        sp_loss_from_logits(logits, torch.tensor([[1, VOCAB, -7, -100]]))
    with pytest.raises(ValueError, match="shift_labels out of range: 4 label"):  # float labels: none usable
        sp_loss_from_logits(logits, torch.zeros(1, 4))


# ---------------------------------------------------------------- models SP cannot serve

def _config(model_type, **extra):
    from transformers import AutoConfig

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return AutoConfig.for_model(model_type, **{**small, **extra})


UNSERVABLE = [
    ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"]), r"layer_types has \['linear_attention'\]"),
    ("lfm2", dict(layer_types=["conv", "full_attention"]), r"layer_types has \['conv'\] at layers \[0\]"),
    ("jamba", dict(attn_layer_period=2, attn_layer_offset=1), "linear_attention"),
    ("minimax", dict(layer_types=["linear_attention", "full_attention"]), "linear_attention"),
    ("recurrent_gemma", dict(block_types=["recurrent", "attention"]), "linear_attention"),
    ("mamba", {}, "'mamba' mixes tokens with a recurrence/state-space scan"),
    ("rwkv", {}, "'rwkv' mixes tokens with a recurrence"),
    ("llama4_text", dict(attention_chunk_size=8, layer_types=["full_attention"] * 2),
     r"chunked attention \(attention_chunk_size=8\) is not honoured"),
]


@pytest.mark.parametrize("model_type,extra,phrase", UNSERVABLE, ids=[c[0] for c in UNSERVABLE])
def test_models_that_mix_tokens_outside_attention_are_refused(model_type, extra, phrase):
    with pytest.raises(ValueError, match="model not servable by Ulysses SP: .*" + phrase):
        check_model_servable(_config(model_type, **extra))


def test_layer_type_chunked_attention_is_refused():
    with pytest.raises(ValueError, match=r"layer_types has \['chunked_attention'\]"):
        check_model_servable(_config("llama4_text", layer_types=["chunked_attention", "full_attention"]))


def test_config_without_attention_heads_is_refused():
    with pytest.raises(ValueError, match="has no attention head count"):
        check_model_servable(types.SimpleNamespace(model_type="custom", num_attention_heads=None))


def test_registration_refuses_a_hybrid_model_object_before_building_groups():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config(
        "qwen3_next", layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2))
    # sp 2 in a 1-process world: reaching the mesh would raise a different error
    with pytest.raises(ValueError, match=r"model not servable by Ulysses SP: layer_types has \['linear_attention'\]"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)


def test_a_token_mixing_module_is_found_even_when_the_config_looks_plain():
    model = tiny_model(tiny_config("llama"))
    model.model.layers[1].mlp.shift = torch.nn.Conv1d(16, 16, 3)  # a causal conv mixing tokens
    with pytest.raises(ValueError, match=r"'layers.1.mlp.shift' \(Conv1d\) mixes tokens outside attention"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)


def test_name_path_registration_refuses_a_hybrid_checkpoint(tmp_path):
    _config("jamba", attn_layer_period=2, attn_layer_offset=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model not servable by Ulysses SP"):
        UlyssesSPAttentionHF.register_with_transformers(str(tmp_path), "sdpa", 2, 1)


# ---------------------------------------------------------------- the failure watch, one rank

def test_watch_leaves_ordinary_errors_alone_and_names_group_and_step_for_collectives():
    watch = GroupWatch([4, 5], timeout_seconds=10)
    watch.step = 7
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        with watch.collective("x"):
            raise RuntimeError("shape mismatch")
    assert not isinstance(info.value, SPCommError)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(SPCommError, match=r"SP group ranks \[4, 5\]: the test's gather failed at step 7 "
                                              r"\(.*\); .*comm_timeout_seconds=10"):
            with watch.collective("the test's gather"):
                dist.all_gather([torch.zeros(1)], torch.zeros(2))  # a collective that fails
        with pytest.raises(SPCommError, match=r"SP group ranks \[4, 5\]: the per-layer all-to-all failed"):
            try:
                dist.all_gather([torch.zeros(1)], torch.zeros(2))
            except RuntimeError as err:
                watch.reraise("the per-layer all-to-all", err)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- bad inputs on 2 ranks

def _adapter_next(rank, group, batches, **kwargs):
    next(iter(UlyssesSPDataLoaderAdapter([batches[rank]], rank, group, 2, "cpu", **kwargs)))


def _sc_label_range(rank, group):
    labels = torch.arange(8)[None].clone()
    if rank == 1:
        labels[0, 3] = 500
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "labels": labels}] * 2, vocab_size=VOCAB)


def _sc_not_json(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "meta": {1, 2}}, {"input_ids": _ids(1, 8), "meta": "x"}])


def _sc_left_padding(rank, group):
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0 if rank == 1 else 1
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8), "attention_mask": mask}] * 2)


def _sc_unpadded_length(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 6)}, {"input_ids": _ids(1, 7)}], pad_to_multiple=False)


def _sc_both_bad(rank, group):
    _adapter_next(rank, group, [{"input_ids": _ids(1, 8).float()}] * 2)


_MESH: dict = {}  # one mesh per spawned process, shared by its scenarios


def _mesh():
    if "mesh" not in _MESH:
        _MESH["mesh"] = build_mesh(2, timeout_seconds=SCENARIO_TIMEOUT)
    return _MESH["mesh"]


def _sp_model(rank, group, dtype=torch.float32, **register):
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2)).to(dtype)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=_mesh(), **register)
    return model


def _shard(rank, bs=1, sl_l=4):
    return _ids(bs, sl_l), torch.arange(rank * sl_l, (rank + 1) * sl_l).expand(bs, sl_l).clone()


def _sc_pos_float(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos.float() if rank == 1 else pos)


def _sc_pos_missing(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=None if rank == 0 else pos)


def _sc_pos_shape(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos[:, :3] if rank == 1 else pos)


def _sc_pos_negative(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos - 10 if rank == 0 else pos)


def _sc_batch_sizes(rank, group):
    ids, pos = _shard(rank, bs=2 if rank == 0 else 1)
    _sp_model(rank, group)(input_ids=ids, position_ids=pos)


def _sc_dtypes(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group, torch.float64 if rank == 1 else torch.float32)(input_ids=ids, position_ids=pos)


def _sc_fixed_length(rank, group):
    ids, pos = _shard(rank)
    _sp_model(rank, group, seq_length=32, seq_length_is_variable=False)(input_ids=ids, position_ids=pos)


def _loss_with_bad_label(rank, group, loss_fn):
    model = _sp_model(rank, group)
    enable_sp_loss(model, group, loss_fn=loss_fn, watch=_mesh().sp_watch)
    ids, pos = _shard(rank)
    labels = _ids(1, 4)
    if rank == 1:
        labels[0, 0] = 999
    model(input_ids=ids, position_ids=pos, shift_labels=labels)


def _sc_loss_label(rank, group):
    _loss_with_bad_label(rank, group, None)


def _sc_tiled_loss_label(rank, group):
    _loss_with_bad_label(rank, group, tiled_causal_lm_loss(2))


def _sc_window_in_mask_only(rank, group):
    from transformers import AutoModelForCausalLM

    cfg = _config("qwen2_moe", vocab_size=VOCAB, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  num_experts=2, num_experts_per_tok=1, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=_mesh())
    ids, pos = _shard(rank)
    model(input_ids=ids, position_ids=pos)


def _sc_config_disagreement(rank, group):
    from ds_ulysses.engine import _check_ranks_agree

    section = UlyssesConfig(sequence_parallel_size=2 if rank == 0 else 1)
    _check_ranks_agree(section, tiny_model(tiny_config("llama")))


def _sc_model_disagreement(rank, group):
    from ds_ulysses.engine import _check_ranks_agree

    _check_ranks_agree(UlyssesConfig(sequence_parallel_size=2), tiny_model(tiny_config("llama", heads=4 + 4 * rank)))


SCENARIOS = {
    "label_range": (_sc_label_range, r"ValueError: SP rank 1: 'labels' has a value out of range: expected -100 or "
                                     rf"\[0, {VOCAB}\), got 500"),
    "not_json": (_sc_not_json, "ValueError: SP rank 0: non-tensor batch entries 'meta' \\(set\\) are not "
                               "JSON-serializable.*never pickled"),
    "left_padding": (_sc_left_padding, "SP rank 1: attention_mask has padding before real tokens"),
    "unpadded_length": (_sc_unpadded_length, "SP rank 1: sequence length 7 is not divisible by "
                                             "sequence_parallel_size=2"),
    "both_bad": (_sc_both_bad, r"SP rank 0 \(ranks \[1\] failed too\): 'input_ids' must be an integer tensor"),
    "pos_float": (_sc_pos_float, "SP rank 1: position_ids must be an integer tensor, got float32"),
    "pos_missing": (_sc_pos_missing, "SP rank 0: Ulysses SP needs position_ids in the model call"),
    "pos_shape": (_sc_pos_shape, r"SP rank 1: position_ids must have shape \[bs, sl_l\] = \[1, 4\] or \[1, 4\], "
                                 r"got \[1, 3\]"),
    "pos_negative": (_sc_pos_negative, "SP rank 0: position_ids must be >= 0, got -10"),
    "batch_sizes": (_sc_batch_sizes, r"SP ranks disagree on the batch size: per SP rank \[2, 1\]"),
    "dtypes": (_sc_dtypes, r"SP ranks disagree on the attention dtype: per SP rank \['float32', 'float64'\]"),
    "fixed_length": (_sc_fixed_length, "seq_length_is_variable is false with seq_length=32, but this forward's "
                                       r"shards add up to 8 tokens \[4, 4\]"),
    "loss_label": (_sc_loss_label, r"shift_labels out of range: 1 label\(s\) across SP group ranks \[0, 1\]"),
    "tiled_loss_label": (_sc_tiled_loss_label, r"shift_labels out of range: 1 label\(s\) across SP group ranks"),
    "window_in_mask_only": (_sc_window_in_mask_only, "model not servable by Ulysses SP: layer 0 attends within a "
                                                     "sliding window, but its attention call passes no sliding_window"),
    "config_disagreement": (_sc_config_disagreement, r"ranks disagree on the \"ulysses\" section or the model's "
                                                     r"layout: ranks \[0\] vs \[1\]"),
    "model_disagreement": (_sc_model_disagreement, r"ranks disagree on .* ranks \[0\] vs \[1\]"),
}


@pytest.fixture(scope="module")
def two_rank_errors():
    return run_distributed(_run_scenarios, 2, list(SCENARIOS), timeout=600)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(name, two_rank_errors):
    import re

    phrase = SCENARIOS[name][1]
    messages = [ranks[name] for ranks in two_rank_errors]
    assert messages[0] == messages[1], messages
    assert re.search(phrase, messages[0]), messages[0]


# ---------------------------------------------------------------- multimodal: the vision tower is left alone

def _llava(seed: int = 0):
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1,
                         vision_feature_layer=-1)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()


def _vision_features(model, pixels):
    out = model.get_image_features(pixel_values=pixels)
    features = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state
    return torch.cat([f.flatten() for f in features]) if isinstance(features, (list, tuple)) else features


def _count_collectives(fn):
    counts = {"n": 0}
    saved = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather", "all_reduce")}

    def counted(original):
        def call(*args, **kwargs):
            counts["n"] += 1
            return original(*args, **kwargs)
        return call
    for name, original in saved.items():
        setattr(dist, name, counted(original))
    try:
        result = fn()
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    return result, counts["n"]


def _multimodal_per_model(rank, world_size):
    model = _llava()
    ref = copy.deepcopy(model)
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    before = _vision_features(model, pixels)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1)
    after, calls = _count_collectives(lambda: _vision_features(model, pixels))
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    sample = make_sample(3, 16)
    sample["input_ids"] = sample["input_ids"].clamp(max=VOCAB - 2)  # no image tokens in a text-only sample
    sample["labels"] = sample["input_ids"].clone()
    sl_l = 16 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    shift = torch.nn.functional.pad(sample["labels"][:, 1:], (0, 1), value=-100)
    loss = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard],
                 shift_labels=shift[:, shard]).loss
    return {"vision_impl": model.config.vision_config._attn_implementation,
            "text_impl": model.config.text_config._attn_implementation,
            "vision_same": bool(torch.equal(before, after)), "vision_collectives": calls,
            "loss_err": rel_err(loss.detach(), reference_loss(ref, sample).detach())}


def test_multimodal_model_only_its_text_attention_runs_sp():
    for res in run_distributed(_multimodal_per_model, 2):
        assert res["vision_impl"] == "sdpa" and res["text_impl"].startswith("ulysses"), res
        assert res["vision_same"] and res["vision_collectives"] == 0, res
        assert res["loss_err"] <= 1e-5, res


def _multimodal_by_name(rank, world_size, path):
    from transformers import AutoModelForImageTextToText

    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    before = _vision_features(AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa"), pixels)
    UlyssesSPAttentionHF.register_with_transformers(path, "sdpa", world_size, 1)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa")
        after, calls = _count_collectives(lambda: _vision_features(model, pixels))
    finally:
        unregister_from_transformers()
    return {"vision_same": bool(torch.equal(before, after)), "vision_collectives": calls}


def test_global_registration_leaves_vision_attention_alone(tmp_path):
    """DeepSpeed #7834: overriding the global sdpa entry also hit the vision tower."""
    _llava().save_pretrained(tmp_path)
    for res in run_distributed(_multimodal_by_name, 2, str(tmp_path)):
        assert res["vision_same"] and res["vision_collectives"] == 0, res


# ---------------------------------------------------------------- flash_attention_2: window and kernel name

def _flash_window(rank, world_size):
    """Transformers' own flash_attention_forward under SP, with the kernel call replaced by an exact
    stand-in that records what reached it."""
    import transformers.integrations.flash_attention as fa

    seen = []

    def kernel(query, key, value, attention_mask, query_length, is_causal, dropout=0.0, softmax_scale=None,
               sliding_window=None, attn_implementation=None, position_ids=None, **kwargs):
        seen.append((attn_implementation, sliding_window))
        # [bs sl hc hs]; causal, per document (from the global positions), within the window
        bs, sl, hq, _ = query.shape
        rep = hq // key.shape[2]
        k, v = (x.repeat_interleave(rep, 2).transpose(1, 2) for x in (key, value))
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        doc = starts.cumsum(1)
        i = torch.arange(sl)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
        mask = mask[None] & (doc[:, :, None] == doc[:, None, :])
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                                               scale=softmax_scale)
        return out.transpose(1, 2)

    fa._flash_attention_forward = kernel
    cfg = tiny_config("mistral", heads=4, kv_heads=2, sliding_window=8)
    model = tiny_model(cfg)
    ref = copy.deepcopy(model)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", world_size, 1)
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    sample = make_sample(5, 40, docs=[30, 10])
    sl_l = 40 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    shift = torch.nn.functional.pad(sample["labels"][:, 1:], (0, 1), value=-100)
    loss = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard],
                 shift_labels=shift[:, shard]).loss
    return {"seen": sorted(set(seen)), "name_after": model.config._attn_implementation,
            "loss_err": rel_err(loss.detach(), reference_loss(ref, sample).detach())}


def test_flash_attention_2_gets_the_window_and_its_own_kernel_name():
    for res in run_distributed(_flash_window, 2):
        assert res["seen"] == [("flash_attention_2", 8)], res
        assert res["name_after"].startswith("ulysses"), res
        assert res["loss_err"] <= 1e-5, res


# ---------------------------------------------------------------- a rank dies or stalls mid-step

def _launch_failure(mode: str, timeout: float, tmp_path) -> dict:
    """Both ranks of tests/rank_failure.py; rank 1 fails at step 2. How and when did rank 0 end?"""
    stamp = tmp_path / "failed_at"
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.rank_failure", mode, str(timeout), str(stamp)],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        code = procs[0].wait(timeout=600)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs[0].seek(0)
    output = logs[0].read()
    for log in logs:
        log.close()
    failed_at = float(stamp.read_text()) if stamp.exists() else None
    return {"code": code, "output": output, "seconds": None if failed_at is None else ended - failed_at}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_survivor_exits_naming_group_and_step_within_the_timeout(mode, tmp_path):
    timeout = 10
    res = _launch_failure(mode, timeout, tmp_path)
    tail = res["output"][-3000:]
    assert res["seconds"] is not None, tail  # rank 1 reached step 2
    assert res["code"] != 0, tail
    assert "SPCommError: SP group ranks [0, 1]" in res["output"] and "failed at step 2" in res["output"], tail
    assert "survivor finished every step" not in res["output"], tail
    assert res["seconds"] < timeout + 30, (res["seconds"], tail)


# ---------------------------------------------------------------- properties of the adapter

@st.composite
def raw_batches(draw, vocab=VOCAB):
    """A collated batch: random size, lengths, packing, ignored labels, optional keys."""
    bs = draw(st.integers(1, 3))
    docs = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    sl = sum(docs)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, vocab, (bs, sl), generator=g)
    labels = torch.where(torch.rand(bs, sl, generator=g) < 0.2, torch.full_like(ids, -100), ids)
    batch = {"input_ids": ids, "labels": labels}
    positions = draw(st.sampled_from(["packed", "given", "generated", "broadcast"]))
    if positions == "packed":
        batch["position_ids"] = torch.cat([torch.arange(n) for n in docs]).expand(bs, sl).clone()
    elif positions in ("given", "broadcast"):
        batch["position_ids"] = torch.arange(sl).expand(1 if positions == "broadcast" else bs, sl).clone()
    if draw(st.booleans()):
        batch["attention_mask"] = torch.ones(bs, sl, dtype=torch.long)
    if draw(st.booleans()):
        batch["source"] = draw(st.sampled_from(["a", ["b", 2], {"k": 1.5}, None]))
    return batch


@settings(max_examples=200, deadline=None)
@given(raw_batches(), st.integers(1, 8), st.integers(0, VOCAB - 1))
def test_prepare_sample_pads_shifts_and_continues_positions(batch, sp, pad_id):
    from ds_ulysses.packed import find_documents

    out = prepare_sample(batch, sp, pad_token_id=pad_id, vocab_size=VOCAB)
    bs, sl = batch["input_ids"].shape
    length = out["input_ids"].shape[1]
    assert length % sp == 0 and sl <= length < sl + sp
    assert "labels" not in out and set(out) == (set(batch) - {"labels"}) | {"shift_labels", "position_ids"}
    assert torch.equal(out["input_ids"][:, :sl], batch["input_ids"])
    assert bool((out["input_ids"][:, sl:] == pad_id).all())
    shift = out["shift_labels"]
    assert torch.equal(shift[:, :sl - 1], batch["labels"][:, 1:]) and bool((shift[:, sl - 1:] == -100).all())
    assert int((shift != -100).sum()) == int((batch["labels"][:, 1:] != -100).sum())  # same loss tokens
    pos = out["position_ids"]
    given_pos = batch.get("position_ids", torch.arange(sl).expand(bs, sl))
    assert torch.equal(pos[:, :sl], given_pos)
    assert torch.equal(pos[:, sl:], pos[:, sl - 1:sl] + torch.arange(1, length - sl + 1))  # the last document goes on
    assert len(find_documents(pos).spans) == len(find_documents(given_pos).spans)  # padding starts no document
    if "attention_mask" in batch:
        assert bool((out["attention_mask"][:, sl:] == 0).all())  # right padding, which SP can honour
    check_batch({k: v for k, v in out.items() if k != "shift_labels"} | {"labels": out["shift_labels"]}, VOCAB)


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(st.data())
def _adapter_shards_property(data):
    """Run identically on every rank (derandomized, no shrinking), so collectives stay in step."""
    rank, ws, group = _ADAPTER_CTX["rank"], _ADAPTER_CTX["ws"], _ADAPTER_CTX["group"]
    keys = data.draw(st.sampled_from([("position_ids",), (), ("attention_mask", "source")]))
    batches = []
    for _ in range(ws):  # every rank's batch: its own size and length (ragged ranks)
        b = data.draw(raw_batches())
        b = {k: v for k, v in b.items() if k in ("input_ids", "labels") + keys}
        b.update({k: torch.ones_like(b["input_ids"]) if k == "attention_mask" else "doc"
                  for k in keys if k not in b and k != "position_ids"})
        if "position_ids" in keys and "position_ids" not in b:
            b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"]).clone()
        batches.append(b)
    adapter = UlyssesSPDataLoaderAdapter([batches[rank]], rank, group, ws, "cpu", vocab_size=VOCAB)
    micro = list(adapter)
    assert len(micro) == len(adapter) == ws
    for k, got in enumerate(micro):
        full = prepare_sample(batches[k], ws)
        sl_l = full["input_ids"].shape[1] // ws
        assert list(got) == list(full)  # same keys, same order
        for key, value in full.items():
            if torch.is_tensor(value):
                assert torch.equal(got[key], value[:, rank * sl_l:(rank + 1) * sl_l]), (key, k)
            else:
                assert got[key] == value, key
    _ADAPTER_CTX["examples"] += 1


_ADAPTER_CTX: dict = {}


def _adapter_property(rank, world_size):
    _ADAPTER_CTX.update(rank=rank, ws=world_size, group=dist.new_group(list(range(world_size))), examples=0)
    _adapter_shards_property()
    return _ADAPTER_CTX["examples"]


@pytest.mark.parametrize("world", [2, 3])
def test_adapter_shards_reassemble_every_ranks_padded_sample(world):
    """Rank r's shard of micro-batch k is the r-th slice of rank k's prepared sample: concatenated
    over ranks, the shards reproduce it exactly (ragged lengths, packing, any sp)."""
    counts = run_distributed(_adapter_property, world, timeout=600)
    assert counts[0] == counts[-1] >= 10


# ---------------------------------------------------------------- schema: values below their minimum

SCHEMA_PROPS = load_schema()["properties"]
BOUNDED = [name for name, prop in SCHEMA_PROPS.items() if "minimum" in prop or "exclusiveMinimum" in prop]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BOUNDED), st.integers(1, 10**6), st.booleans())
def test_random_values_below_a_minimum_are_rejected_naming_the_field(name, below, as_float):
    prop = SCHEMA_PROPS[name]
    if "minimum" in prop:
        value = prop["minimum"] - below
    else:
        value = prop["exclusiveMinimum"] - below + 1
    if as_float and "number" in prop["type"]:
        value = float(value) - 0.5
    with pytest.raises(UlyssesConfigError) as info:
        UlyssesConfig.from_dict({name: value})
    assert any(e.startswith(f"ulysses.{name}: expected ") for e in info.value.errors), info.value.errors


# ---------------------------------------------------------------- no unpickling of user data

def _unsafe(code: str) -> bool:
    import re

    if re.search(r"^\s*(import pickle|from pickle)", code) or re.search(r"torch\.load\((?![^)]*weights_only=True)", code):
        return True
    for m in re.finditer(r"\b(all_gather_object|broadcast_object_list|scatter_object_list|gather_object|"
                         r"recv_object_list|pickle\.loads?|yaml\.load|eval|exec)\(", code):
        if not (m.group(1) == "eval" and code[:m.start()].endswith(".")):  # model.eval() is fine
            return True
    return False


def test_package_never_unpickles_or_evaluates_data():
    """Peers' batches travel as JSON, configs are JSON, checkpoints load with weights_only=True."""
    assert _unsafe("dist.all_gather_object(out, meta)") and _unsafe("torch.load(f)") and not _unsafe("m.eval()")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted((REPO / "ds_ulysses").glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if _unsafe(line.split("#")[0])]
    assert not found, found
