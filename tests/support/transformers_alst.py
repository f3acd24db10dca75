"""Transformers' ALST test (``tests/deepspeed/test_alst_ulysses_sp.py::test_sp_equivalence``), step by step in
our code with the one line README asks for, ``ds_ulysses.install()``: the Trainer on a model from
``from_pretrained``, 8 texts padded to 128 tokens by the tokenizer (on its own side: Llama's pads on the left),
``DataCollatorForLanguageModeling(pad_to_multiple_of=4)``, 10 steps, then an evaluation on 127-token samples
(not divisible by sp: served without SP, ``disable_in_eval``). Launched by ``accelerate launch`` with SP from
``parallelism_config`` in the Accelerate config and without it, from the directory :mod:`tests.support.local_hub`
wrote; ``--loss_output_file`` and ``--eval_output_file`` name where rank 0 writes the logged losses and the
evaluation's metrics; every other argument is a ``TrainingArguments`` field.
"""

from __future__ import annotations

import json
import sys

#: the DeepSpeed config the upstream test launches with (ZeRO-2, optimizer offload, "auto" for the Trainer)
DS_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _take(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    at = argv.index(flag)
    value = argv[at + 1]
    del argv[at:at + 2]
    return value


def main(argv: list[str]) -> None:
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,
                              HfArgumentParser, Trainer, TrainingArguments)

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world
    from tests.support.local_hub import MODEL_NAME, TEXTS

    report_gloo_world()
    ds_ulysses.install()
    loss_file, eval_file = _take(argv, "--loss_output_file"), _take(argv, "--eval_output_file")
    (args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses(argv)
    args.do_eval = True
    tokenizer = AutoTokenizer.from_pretrained(MODEL_NAME)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(MODEL_NAME, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 1
    texts = [text * 10 for text in TEXTS] * 4  # 8 samples
    train = [tokenizer(text, max_length=128, truncation=True, padding="max_length") for text in texts]
    evaluation = [tokenizer(text, max_length=127, truncation=True, padding="max_length") for text in texts]
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      data_collator=DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False,
                                                                    pad_to_multiple_of=4))
    trainer.train()
    if trainer.state.global_step == 0:
        raise RuntimeError("the Trainer ran no step")
    metrics = trainer.evaluate()
    if args.process_index == 0:
        if eval_file:
            with open(eval_file, "w") as f:
                json.dump(metrics, f)
        if loss_file:
            with open(loss_file, "w") as f:
                json.dump([entry["loss"] for entry in trainer.state.log_history if "loss" in entry], f)


if __name__ == "__main__":
    main(sys.argv[1:])
