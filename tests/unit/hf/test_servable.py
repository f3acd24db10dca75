"""Models SP would compute silently wrong are refused by name, before any collective."""

import types

import pytest
import torch

from ds_ulysses import UlyssesSPAttentionHF
from ds_ulysses.hf.servable import check_model_servable
from tests.support.models import hf_config, tiny_config, tiny_model


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
    ("llama4_text", dict(attention_chunk_size=None, layer_types=["full_attention"] * 2, no_rope_layers=[1, 0],
                         attn_temperature_tuning=True),
     r"'llama4_text' scales the queries of its NoPE layers \[1\] by each token's position \(attn_temperature_tuning, "
     r"floor_scale=8192\)"),
]


@pytest.mark.parametrize("model_type,extra,phrase", UNSERVABLE, ids=[c[0] for c in UNSERVABLE])
def test_models_that_mix_tokens_outside_attention_are_refused(model_type, extra, phrase):
    with pytest.raises(ValueError, match="model not servable by Ulysses SP: .*" + phrase):
        check_model_servable(hf_config(model_type, **extra))


@pytest.mark.parametrize("extra", [dict(attn_temperature_tuning=False), dict(no_rope_layers=[1, 1])],
                         ids=["no-temperature-tuning", "no-nope-layer"])
def test_llama4_without_chunks_is_served_unless_a_nope_layer_scales_its_queries_by_position(extra):
    # the other half of the refusal above: without chunks, these configs are exact (architecture sweep:
    # llama4_text+full), and refusing them would leave Llama 4 no SP at all
    check_model_servable(hf_config("llama4_text", attention_chunk_size=None, layer_types=["full_attention"] * 2,
                                   **{"no_rope_layers": [1, 0], "attn_temperature_tuning": True, **extra}))


def test_layer_type_chunked_attention_is_refused():
    with pytest.raises(ValueError, match=r"layer_types has \['chunked_attention'\]"):
        check_model_servable(hf_config("llama4_text", layer_types=["chunked_attention", "full_attention"]))


def test_config_without_attention_heads_is_refused():
    with pytest.raises(ValueError, match="has no attention head count"):
        check_model_servable(types.SimpleNamespace(model_type="custom", num_attention_heads=None))


def test_registration_refuses_a_hybrid_model_object_before_building_groups():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(
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
    hf_config("jamba", attn_layer_period=2, attn_layer_offset=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model not servable by Ulysses SP"):
        UlyssesSPAttentionHF.register_with_transformers(str(tmp_path), "sdpa", 2, 1)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                   "original_max_position_embeddings": 64}])
def test_rope_scaling_that_follows_the_batch_s_longest_position_is_refused(rope):
    family = "phi3" if rope["rope_type"] == "longrope" else "llama"
    config = tiny_config(family, rope_scaling=rope)
    with pytest.raises(ValueError, match=rf"uses RoPE \['{rope['rope_type']}'\], whose frequencies follow the longest "
                                         r"position in the batch.*fix: set rope_parameters to a static rope_type"):
        check_model_servable(config)


def test_static_rope_scaling_is_served():
    check_model_servable(tiny_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    check_model_servable(tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                            "original_max_position_embeddings": 64}))


@pytest.mark.parametrize("head,why", [
    ("LlamaForSequenceClassification", "reads the sequence as a whole"),
    ("LlamaForQuestionAnswering", "reads the sequence as a whole"),
    ("LlamaForTokenClassification", "labels each token in place, where the SP adapter shifts labels"),
    ("peft", "reads the sequence as a whole")])
def test_a_head_that_is_not_a_causal_lm_s_is_refused_naming_it(head, why):
    import transformers

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    cfg.pad_token_id = 0
    if head == "peft":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(transformers.LlamaForSequenceClassification(cfg),
                               LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS"))
        head = "LlamaForSequenceClassification"
    else:
        model = getattr(transformers, head)(cfg)
    with pytest.raises(ValueError, match=f"model not servable by Ulysses SP: {head}'s head {why}.* expected a "
                                         r"causal LM \(such as LlamaForCausalLM\)"):
        check_model_servable(cfg, model)


@pytest.mark.parametrize("head", ["LlamaForCausalLM", "LlamaModel"])
def test_a_causal_lm_and_a_bare_decoder_are_not_refused_for_their_head(head):
    import transformers

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    check_model_servable(cfg, getattr(transformers, head)(cfg))


@pytest.mark.parametrize("method", ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig"])
def test_peft_prompt_learning_is_refused_naming_the_adapter(method):
    import peft

    model = peft.get_peft_model(tiny_model(tiny_config("llama", heads=4, kv_heads=2)),
                                getattr(peft, method)(task_type="CAUSAL_LM", num_virtual_tokens=3))
    kind = model.peft_config["default"].peft_type.value
    with pytest.raises(ValueError, match=f"model not servable by Ulysses SP: PEFT prompt learning "
                                         f"\\('default': {kind}\\) puts its virtual tokens in front of the "
                                         "sequence each forward gets"):
        check_model_servable(model.config, model)


def test_peft_lora_is_not_refused():
    import peft

    model = peft.get_peft_model(tiny_model(tiny_config("llama", heads=4, kv_heads=2)),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    check_model_servable(model.config, model)


@pytest.mark.parametrize("model_type,built,core,phrase", [
    ("falcon", "eager", "flash_attention_2", r"'h.0.self_attention' is a FalconAttention, the class "
     r"FALCON_ATTENTION_CLASSES gives for \['eager', 'sdpa'\].*its class for 'flash_attention_2' is "
     r"FalconFlashAttention2.*fix: build the model with attn_implementation='flash_attention_2'"),
    ("falcon", "sdpa", "flash_attention_3", r"the table has no class for 'flash_attention_3'.*fix: build it for, "
     r"and register, a core it has \(flash_attention_2, sdpa\)"),
    ("gpt_neo", "eager", "sdpa", r"'h.0.attn.attention' is a GPTNeoSelfAttention.*a core it has "
     r"\(flash_attention_2\)"),
])
def test_a_model_whose_attention_class_is_picked_when_built_is_refused_for_another_core(model_type, built, core,
                                                                                        phrase):
    """Falcon and GPT-Neo pick their attention class from a table when built; switched to another core, the
    layer keeps computing attention its own way (Falcon's eager class raised a TypeError under flash)."""
    from transformers import AutoModelForCausalLM

    extra = dict(attention_types=[[["global"], 2]]) if model_type == "gpt_neo" else {}
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **extra), attn_implementation=built)
    with pytest.raises(ValueError, match=f"model not servable by Ulysses SP with core attention '{core}': .*{phrase}"):
        UlyssesSPAttentionHF.register_with_transformers(model, core, 2, 1, scope="model")


def test_a_model_built_for_the_core_passes_the_attention_class_check():
    from transformers import AutoModelForCausalLM

    from ds_ulysses.hf.servable import check_attention_classes

    check_attention_classes(AutoModelForCausalLM.from_config(hf_config("falcon"), attn_implementation="sdpa"), "sdpa")
    check_attention_classes(tiny_model(tiny_config("llama")), "flash_attention_2")  # no class table: not judged
