"""One rank of one benchmark launch on TRL's SFTTrainer (``ds-ulysses bench --loop trl``).

The arms of :mod:`benchmarks.trainer`, reached the way a TRL user reaches them: ``SFTConfig`` in place of
``TrainingArguments`` (DeepSpeed's arm with TRL's documented ``parallelism_config``, ours with
``ds_ulysses.install()`` and the section or with ``install()`` and that same ``parallelism_config``), the
same model, samples, ZeRO-3 + CPU offload config and step measurement. The samples are pre-tokenized
(TRL keeps them as they are); the Trainer's loss is TRL's: its fused LM head's token mean, computed tile
by tile without the whole logits.

``SFTConfig``'s defaults stand where a TRL user leaves them, gradient checkpointing (on) included, except
``bf16`` (off: fp32, as in every other loop here) and the two a user of SP sets: ``max_length`` the
sample's length (TRL's default 1024 would truncate) and ``pad_to_multiple_of`` sp (TRL's SP guide).
"""

from __future__ import annotations

from .trainer import train

__all__ = ["run", "word_tokenizer"]


def word_tokenizer(vocab: int):
    """A tokenizer of ``vocab`` words, one per id (built here: nothing is downloaded). TRL asks for one to pad
    with; the samples come tokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", unk_token="t1", eos_token="t2")


def run(spec: dict) -> dict:
    """Train ``warmup + steps`` steps of TRL's SFTTrainer with one arm; return this rank's measurements in
    :func:`benchmarks.engine_loop.run`'s shape."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    def build(args, model, data, callbacks, recording):
        config = SFTConfig(**args, bf16=False, max_length=spec["seq_len"], pad_to_multiple_of=spec["sp"])
        rows = datasets.Dataset.from_list([{"input_ids": sample["input_ids"].tolist()} for sample in data])
        return recording(SFTTrainer)(model=model, args=config, train_dataset=rows, callbacks=callbacks,
                                     processing_class=word_tokenizer(model.config.vocab_size))

    return train(spec, "trl", build)
