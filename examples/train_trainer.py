"""Transformers' Trainer with Ulysses SP, switched on by the DeepSpeed config's "ulysses" section.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_trainer.py           # 2 CPU ranks, sp 2
    deepspeed --num_gpus 8 examples/train_trainer.py --seq-len 65536              # GPUs: sp 2 x dp 4
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_trainer.py --sp-size 2  # parallelism_config too

The only SP-specific line is ``ds_ulysses.install()`` before the Trainer is created; everything else is
a plain Trainer script. The section (or ``parallelism_config``) gives the mesh, the attention, the
sharded train loader, DeepSpeed's batch arithmetic and an SP loss that is exact under ZeRO-1/2/3.
Trains the tiny byte-level Llama on the Python standard library's source, evaluates (without SP: each
rank evaluates whole held-out samples), and saves a plain HF model to OUT/final.
"""

import argparse

import torch
from accelerate.parallelism_config import ParallelismConfig
from transformers import Trainer, TrainingArguments

import ds_ulysses
from ds_ulysses.train.corpus import PackedSamples, load_tokenizer, stdlib_texts
from ds_ulysses.train.recipe import build_model, set_cpu_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default="examples/ds_config_trainer.json", help="DeepSpeed config file")
    p.add_argument("--sp-size", type=int, help="also pass Transformers' own switch, parallelism_config("
                   "sp_backend='deepspeed', sp_size=N); the config's section must agree (or be left out)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sample (the whole sequence)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--out", default="runs/trainer")
    p.add_argument("--resume", help="a checkpoint directory of an earlier run (OUT/checkpoint-N)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    ds_ulysses.install()  # before the Trainer: its Accelerator and DeepSpeed engine are built SP-aware
    set_cpu_threads()
    if not torch.cuda.is_available():
        from cpu_gloo import report_gloo_world

        report_gloo_world()
    tokenizer = load_tokenizer(None)
    model = build_model(None, tokenizer)  # before TrainingArguments (a ZeRO-3 config would partition it at birth)
    data = PackedSamples(stdlib_texts, tokenizer, args.seq_len, args.eval_samples + 4 * args.steps)
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp_size) if args.sp_size else None
    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=args.steps,
        learning_rate=2e-3, warmup_steps=2, logging_steps=1, save_steps=max(1, args.steps // 2), report_to=[],
        deepspeed=args.deepspeed, parallelism_config=pc, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=data.subset(args.eval_samples),
                      eval_dataset=data.subset(0, args.eval_samples))
    trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.out}/final")
    if trainer.is_world_process_zero():
        sp = trainer.accelerator.parallelism_config.sp_size
        print(f"sp={sp}: eval loss {metrics['eval_loss']:.4f}; saved {args.out}/final "
              "(AutoModelForCausalLM.from_pretrained loads it without SP)", flush=True)


if __name__ == "__main__":
    main()
