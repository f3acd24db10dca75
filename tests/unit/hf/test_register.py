"""Registering the SP attention with Transformers: DeepSpeed's global contract, the per-model scope,
refusals, Hub kernels, and the undo."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from ds_ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, enable_sp_loss, unregister_from_transformers
from tests.support.distributed import run_distributed
from tests.support.models import VOCAB, hf_config, rel_err, tiny_config, tiny_model
from tests.support.sp_cases import make_sample, reference_loss


def _isolation(rank, world_size):
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    a, b = tiny_model(cfg), tiny_model(cfg)  # built from the same config object
    a.config = b.config = cfg
    for m in list(a.modules()) + list(b.modules()):
        if "config" in m.__dict__:
            m.config = cfg
    x = make_sample(0, 16)
    before = b(input_ids=x["input_ids"]).logits
    UlyssesSPAttentionHF.register_with_transformers(a, "sdpa", world_size, 1, scope="model")
    after = b(input_ids=x["input_ids"]).logits
    return {"same": torch.equal(before, after), "b_impl": b.config._attn_implementation,
            "a_impl": a.config._attn_implementation, "a_private": a.config is not cfg, "b_shared": b.config is cfg}


def test_model_scope_touches_only_that_model():
    for res in run_distributed(_isolation, 2):
        assert res["same"] and res["b_impl"] == res["a_impl"] == "sdpa", res
        assert res["a_private"] and res["b_shared"], res


def _global_registration(rank, world_size, config_dir):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tests.support.sp_cases import reference_loss

    mpu = UlyssesSPAttentionHF.register_with_transformers(config_dir, "sdpa", world_size, 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(config_dir, attn_implementation="sdpa")
    replaced = ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    sample = make_sample(3, 16)
    sl_l = 16 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    shift = torch.nn.functional.pad(sample["labels"][:, 1:], (0, 1), value=-100)
    loss = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard],
                 shift_labels=shift[:, shard]).loss
    unregister_from_transformers()
    restored = ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    plain = AutoModelForCausalLM.from_pretrained(config_dir, attn_implementation="sdpa")
    ref = reference_loss(plain, sample)
    return {"replaced": replaced, "restored": restored, "err": rel_err(loss.detach(), ref.detach())}


def test_name_path_registration_is_global_and_reversible(tmp_path):
    tiny_model(tiny_config("llama", heads=4)).save_pretrained(tmp_path)
    for res in run_distributed(_global_registration, 2, str(tmp_path)):
        assert res["replaced"] and res["restored"] and res["err"] <= 1e-5, res


def test_eager_is_refused_with_reason():
    model = tiny_model(tiny_config("llama"))
    with pytest.raises(ValueError, match="eager attention needs a full S x S attention mask.*use 'sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(model, "eager", 2, 1)


def test_unknown_core_is_refused():
    with pytest.raises(ValueError, match="unknown core attention 'xformers'"):
        UlyssesSPAttentionHF.register_with_transformers(tiny_model(tiny_config("llama")), "xformers", 2, 1)


def test_sp_one_returns_none():
    assert UlyssesSPAttentionHF.register_with_transformers(tiny_model(tiny_config("llama")), "sdpa", 1, 1) is None


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
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, scope="model")
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
        assert res["vision_impl"] == res["text_impl"] == "sdpa", res
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
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", world_size, 1, scope="model")
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
        assert res["name_after"] == "flash_attention_2", res  # the model keeps the core's name
        assert res["loss_err"] <= 1e-5, res


class _ConfigHolder:
    """What DeepSpeed's PEFT test passes: an object with ``.config`` and nothing else."""

    def __init__(self, config):
        self.config = config


def _deepspeed_contract(rank, world_size):
    """Registration from a config holder serves a model built afterwards: its SP logits on this rank's
    shard equal the unsharded model's logits there (DeepSpeed's global replacement)."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    ref = tiny_model(cfg)
    sample = make_sample(2, 16)
    with torch.no_grad():
        want = ref(input_ids=sample["input_ids"], position_ids=sample["position_ids"]).logits  # [1 16 V]
    mpu = UlyssesSPAttentionHF.register_with_transformers(_ConfigHolder(cfg), "sdpa", world_size, 1)
    model = tiny_model(cfg)  # built after the call, same weights
    sl_l = 16 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    with torch.no_grad():
        got = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard]).logits
    unregister_from_transformers()
    return {"mpu": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()),
            "err": rel_err(got, want[:, shard])}


def test_a_config_holder_registers_globally_for_models_built_later():
    for rank, res in enumerate(run_distributed(_deepspeed_contract, 2)):
        assert res["mpu"] == (2, rank) and res["err"] <= 1e-5, res


def _registered_twice(rank, world_size):
    """A second registration in one process (a notebook cell run again) serves its model on the first's
    groups; DeepSpeed's raises "sequence parallel group is already initialized"."""
    sample = make_sample(4, 16)
    sl_l = 16 // world_size
    shard = slice(rank * sl_l, (rank + 1) * sl_l)
    mpus, errs = [], []
    for cfg in [tiny_config("llama", heads=4, kv_heads=2), tiny_config("qwen2", heads=2)]:
        ref, model = tiny_model(cfg), tiny_model(cfg)
        with torch.no_grad():
            want = ref(input_ids=sample["input_ids"], position_ids=sample["position_ids"]).logits  # [1 16 V]
        mpus.append(UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1))
        with torch.no_grad():
            got = model(input_ids=sample["input_ids"][:, shard], position_ids=sample["position_ids"][:, shard]).logits
        errs.append(rel_err(got, want[:, shard]))
    unregister_from_transformers()
    return {"same_group": mpus[0].get_sequence_parallel_group() is mpus[1].get_sequence_parallel_group(),
            "err": max(errs)}


def test_a_second_registration_in_one_process_is_served_on_the_first_ones_groups():
    for res in run_distributed(_registered_twice, 2):
        assert res["same_group"] and res["err"] <= 1e-5, res


def _built_later(rank, world_size, config_dir):
    """Models built after a registration by name: what building each (and preparing a PEFT-wrapped one for the
    engine) raised (None: served)."""
    import peft
    import transformers

    from ds_ulysses.config import UlyssesConfig
    from ds_ulysses.engine import prepare_model

    mesh = UlyssesSPAttentionHF.register_with_transformers(config_dir, "sdpa", world_size, 1)
    hybrid = hf_config("qwen3_next", layer_types=["linear_attention", "full_attention"], head_dim=8,
                       linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1)
    builds = {"causal_lm": lambda: transformers.AutoModelForCausalLM.from_pretrained(
                  config_dir, attn_implementation="sdpa"),
              "token_classifier": lambda: transformers.AutoModelForTokenClassification.from_pretrained(
                  config_dir, attn_implementation="sdpa"),
              "hybrid": lambda: transformers.AutoModelForCausalLM.from_config(hybrid, attn_implementation="sdpa")}
    for name, method in (("lora", peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")),
                         ("prompt_tuning", peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))):
        builds[name] = functools.partial(lambda method: prepare_model(
            peft.get_peft_model(builds["causal_lm"](), method), UlyssesConfig(sequence_parallel_size=world_size),
            mesh, 1, 1.0), method)
    errors = {}
    for name, build in builds.items():
        try:
            build()
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    unregister_from_transformers()
    return errors


def test_models_built_after_a_registration_by_name_are_checked_as_they_are_built(tmp_path):
    tiny_model(tiny_config("llama", heads=4)).save_pretrained(tmp_path)
    for errors in run_distributed(_built_later, 2, str(tmp_path)):
        assert errors["causal_lm"] is None and errors["lora"] is None
        assert "model not servable by Ulysses SP: PEFT prompt learning ('default': PROMPT_TUNING)" \
            in errors["prompt_tuning"]
        assert "model not servable by Ulysses SP: LlamaForTokenClassification's head labels each token in place" \
            in errors["token_classifier"]
        assert "model not servable by Ulysses SP: layer_types has ['linear_attention']" in errors["hybrid"]


def test_a_loaded_model_running_another_core_is_refused_like_deepspeed():
    cfg = tiny_config("llama")
    cfg._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="core_attn_implementation='flash_attention_2' does not match model config "
                                         "attn_implementation='sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(_ConfigHolder(cfg), "flash_attention_2", 2, 1)


def test_switching_a_model_to_a_core_its_class_does_not_support_is_refused():
    """scope="model" (what initialize uses) sets the model's attention to the core itself, past Transformers' check:
    GPT-OSS under sdpa trained with its attention sinks dropped (the loss 6e-4 off, silently)."""
    model = tiny_model(tiny_config("gpt_oss", heads=4, kv_heads=2, attn="eager", num_local_experts=2,
                                   num_experts_per_tok=1))
    with pytest.raises(ValueError, match=r"model not servable by Ulysses SP with core attention 'sdpa': "
                                         r"GptOssModel._supports_sdpa is False.* fix: set the ulysses section's "
                                         r"attn_implementation \(or register\) to one of \['flash_attention_2', "
                                         r"'flex_attention'\]"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, scope="model")
    assert model.config._attn_implementation == "eager"


def test_model_scope_needs_a_module():
    with pytest.raises(ValueError, match="scope='model' needs the model object"):
        UlyssesSPAttentionHF.register_with_transformers(_ConfigHolder(tiny_config("llama")), "sdpa", 2, 1,
                                                        scope="model")


def _hub_kernel(rank, world_size):
    """Transformers registers a Hub kernel in its table on first load (stubbed here: nothing can be
    downloaded); registration must trigger that load, wrap the kernel's entry and leave sdpa alone."""
    from transformers import modeling_flash_attention_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    loaded, name, sdpa = [], "kernels-community/flash-attn2", ALL_ATTENTION_FUNCTIONS["sdpa"]

    def register_kernel(implementation, *args, **kwargs):
        loaded.append(implementation)
        ALL_ATTENTION_FUNCTIONS[implementation] = sdpa

    def no_kernels(implementation, *args, **kwargs):
        raise ImportError("kernels is not installed")

    modeling_flash_attention_utils.lazy_import_flash_attention = register_kernel
    cfg = tiny_config("llama")
    cfg._attn_implementation = name
    mpu = UlyssesSPAttentionHF.register_with_transformers(_ConfigHolder(cfg), name, world_size, 1)
    out = {"mpu": mpu is not None, "loaded": loaded, "sdpa_untouched": ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa,
           "kernel_wrapped": ALL_ATTENTION_FUNCTIONS[name] is not sdpa}
    unregister_from_transformers()
    modeling_flash_attention_utils.lazy_import_flash_attention = no_kernels
    try:
        UlyssesSPAttentionHF.register_with_transformers(_ConfigHolder(tiny_config("llama")), "org/kernel@v1:fn",
                                                        world_size, 1)
    except ImportError as err:
        out["missing"] = str(err)
    return out


def test_hub_kernels_are_loaded_through_transformers_and_a_missing_kernels_package_is_named():
    for res in run_distributed(_hub_kernel, 2):
        assert res["mpu"] and res["loaded"] == ["kernels-community/flash-attn2"], res
        assert res["sdpa_untouched"] and res["kernel_wrapped"], res
        assert "is a Hub kernel, which Transformers loads with the `kernels` package" in res["missing"], res
        assert "pip install kernels" in res["missing"], res


def _uninstall(rank, world_size):
    import ds_ulysses
    from transformers import PreTrainedModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tables = (ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    post_init = PreTrainedModel.post_init
    model = tiny_model(tiny_config("llama"))
    config = model.config
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, scope="model")
    ds_ulysses.enable_sp_loss(model)
    ds_ulysses.tile_mlps(model, 2)
    ds_ulysses.register_with_transformers(_ConfigHolder(tiny_config("llama")), "sdpa", world_size, 1)
    ds_ulysses.install()
    import deepspeed
    later = tiny_model(tiny_config("llama"))  # adopted by the global registration
    original_initialize = ds_ulysses.engine.PATCHES.original_attr(deepspeed, "initialize")
    touched = {"config": model.config is not config, "post_init": PreTrainedModel.post_init is not post_init,
               "hooks": bool(later.model._forward_pre_hooks and model.model._forward_pre_hooks),
               "forward": "forward" in vars(model), "mlp": "forward" in vars(model.model.layers[0].mlp),
               "deepspeed": deepspeed.initialize is not original_initialize}
    ds_ulysses.uninstall()
    restored = {"tables": (ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]) == tables,
                "post_init": PreTrainedModel.post_init is post_init,
                "config": model.config is config and all(m.config is config for m in model.modules()
                                                         if "config" in vars(m)),
                "forward": "forward" not in vars(model) and "forward" not in vars(model.model.layers[0].mlp),
                "hooks": not later.model._forward_pre_hooks and not model.model._forward_pre_hooks,
                "deepspeed": deepspeed.initialize.__module__.startswith("deepspeed")}
    return touched, restored


def test_uninstall_restores_every_table_class_and_model_it_touched():
    for touched, restored in run_distributed(_uninstall, 2):
        assert all(touched.values()), touched
        assert all(restored.values()), restored


def _prefix_lm(rank, world_size):
    """HRM-text, a PrefixLM: token_type_ids mark a prefix that attends both ways. Its SP loss with and without
    them, against the unsharded model's."""
    from tests.architectures import build

    base = build("hrm_text")
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(5))
    prefix = torch.zeros_like(ids)
    prefix[:, :12] = 1  # all on rank 0's shard: rank 1's own mask is causal
    positions = torch.arange(32)[None]
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1)
    enable_sp_loss(model, mpu.get_sequence_parallel_group())
    out = {}
    for name, extra in (("causal", {}), ("prefix", {"token_type_ids": prefix})):
        sample = {"input_ids": ids, "labels": ids.clone(), "position_ids": positions, **extra}
        want = ref(input_ids=ids, labels=ids, position_ids=positions, **extra).loss
        micro = next(iter(UlyssesSPDataLoaderAdapter([sample], mpu.get_sequence_parallel_rank(),
                                                     mpu.get_sequence_parallel_group(), world_size, "cpu")))
        try:
            out[name] = rel_err(model(**micro).loss.detach(), want.detach())
        except ValueError as err:
            out[name] = str(err)
    unregister_from_transformers()
    return out


def test_a_mask_that_lets_a_token_see_the_next_one_is_refused_on_every_rank():
    """Without the refusal the prefix's bidirectionality was dropped: the loss 6e-5 off, silently."""
    for out in run_distributed(_prefix_lm, 2):
        assert out["causal"] <= 1e-5
        assert out["prefix"].startswith("SP rank 0: the model's attention mask lets a token attend to the token "
                                        "after it (a bidirectional overlay: a PrefixLM's prefix from token_type_ids")


def _positions_from_the_model_call(rank, world_size):
    """GPT-BigCode: its attention calls get no position_ids, its position embedding takes the model call's.
    Two packed samples with documents in different places, under gradient checkpointing: a backward after
    each forward gives the gradients of the same steps without checkpointing (whose recompute takes the
    positions of the forward it recomputes), also after a forward left without backward; a backward after
    another forward has begun (a second training forward, or a forward without gradients) is refused."""
    from tests.architectures import build

    base = build("gpt_bigcode")
    positions = [torch.cat([torch.arange(10), torch.arange(22)])[None],
                 torch.cat([torch.arange(23), torch.arange(9)])[None]]
    samples = []
    for seed, pos in enumerate(positions):
        ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(seed))
        samples.append({"input_ids": ids, "labels": ids.clone(), "position_ids": pos})

    def run(checkpointing, steps):
        model = copy.deepcopy(base).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, 1, scope="model")
        enable_sp_loss(model, mpu.get_sequence_parallel_group())
        micros = [next(iter(UlyssesSPDataLoaderAdapter([s], mpu.get_sequence_parallel_rank(),
                                                       mpu.get_sequence_parallel_group(), world_size, "cpu")))
                  for s in samples]
        try:
            steps(model, micros)
            return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        except ValueError as err:
            return str(err)
        finally:
            unregister_from_transformers()

    def each(model, micros):
        for m in micros:
            model(**m).loss.backward()

    def abandoned_first(model, micros):  # a forward whose loss never reaches backward (it raised, say)
        model(**micros[1])
        each(model, micros)

    def together(model, micros):
        sum(model(**m).loss for m in micros).backward()

    def no_grad_between(model, micros):
        loss = model(**micros[0]).loss
        with torch.no_grad():
            model(**micros[1])
        loss.backward()

    plain = run(False, each)
    return {"each": rel_err(run(True, each), plain), "abandoned": rel_err(run(True, abandoned_first), plain),
            "together": run(True, together), "no_grad_between": run(True, no_grad_between)}


def test_positions_from_the_model_call_serve_checkpointing_one_forward_at_a_time():
    for out in run_distributed(_positions_from_the_model_call, 2):
        assert out["each"] <= 1e-5 and out["abandoned"] <= 1e-5
        for refused in (out["together"], out["no_grad_between"]):
            assert isinstance(refused, str) and refused.startswith(
                "Ulysses SP cannot back-propagate a forward of GPTBigCodeModel after another forward of it has begun")


def _fa2_like(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
              causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """The flash-attn package's varlen signature: no sinks."""


def _fa3_vllm_like(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                   window_size=(-1, -1), s_aux=None):
    """A kernel taking sinks as s_aux (vLLM's FA3)."""


def _fa4_like(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
              learnable_sink=None):
    """A kernel taking sinks as learnable_sink (FA4)."""


def _with_kernel(monkeypatch, varlen_fn):
    """Transformers' flash path loading a kernel with `varlen_fn`'s signature (its own inspection of it)."""
    from transformers import modeling_flash_attention_utils as fa_utils

    process = fa_utils._lazy_define_process_function(varlen_fn)
    monkeypatch.setattr(fa_utils, "lazy_import_flash_attention", lambda *args, **kwargs: ((None,) * 5, (process, dict)))


def test_attention_sinks_are_refused_where_the_flash_kernel_would_drop_them(monkeypatch):
    """Transformers hands s_aux only to a kernel whose signature takes it (s_aux or learnable_sink) and drops it
    silently otherwise: the check reads the loaded kernel as Transformers does, refuses the flash-attn package's,
    and lets sink-taking kernels and a core function of the user's own pass."""
    from transformers.integrations.flash_attention import flash_attention_forward

    from ds_ulysses.hf.register import _Dispatch

    _with_kernel(monkeypatch, _fa2_like)
    with pytest.raises(ValueError, match=r"core attention 'flash_attention_2': its attention passes attention sinks "
                                         r"\(s_aux, GPT-OSS's\), and this core's flash kernel takes none"):
        _Dispatch("flash_attention_2", flash_attention_forward, None).check_sinks_reach_kernel()
    own = _Dispatch("flash_attention_2", lambda *args, **kwargs: None, None)
    own.check_sinks_reach_kernel()  # not Transformers' flash function: its kernel is the user's business
    assert own.sinks_reach_kernel
    for kernel in (_fa3_vllm_like, _fa4_like):
        _with_kernel(monkeypatch, kernel)
        dispatch = _Dispatch("flash_attention_2", flash_attention_forward, None)
        dispatch.check_sinks_reach_kernel()
        assert dispatch.sinks_reach_kernel, kernel.__name__


def _sinks_reach_the_flash_kernel(rank, world_size):
    """GPT-OSS under SP on Transformers' own flash_attention_2 entry, its kernel the flash-attn package's
    signature: the first forward is refused on every rank before any kernel runs."""
    from transformers import modeling_flash_attention_utils as fa_utils

    from tests.architectures import build

    process = fa_utils._lazy_define_process_function(_fa2_like)
    fa_utils.lazy_import_flash_attention = lambda *args, **kwargs: ((None,) * 5, (process, dict))
    model = build("gpt_oss", attn="eager")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "flash_attention_2", world_size, 1, scope="model")
    try:
        sample = make_sample(0, 32)
        micro = next(iter(UlyssesSPDataLoaderAdapter([sample], mpu.get_sequence_parallel_rank(),
                                                     mpu.get_sequence_parallel_group(), world_size, "cpu")))
        model(**micro)
    except ValueError as err:
        return str(err)
    finally:
        unregister_from_transformers()
    return "served"


def test_gpt_oss_sinks_on_a_flash_kernel_without_them_are_refused_at_the_first_forward():
    for out in run_distributed(_sinks_reach_the_flash_kernel, 2):
        assert out.startswith("model not servable by Ulysses SP with core attention 'flash_attention_2': its "
                              "attention passes attention sinks"), out
