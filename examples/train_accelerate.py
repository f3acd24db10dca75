"""A plain Accelerate training loop with Ulysses SP from the DeepSpeed config's "ulysses" section.

    accelerate launch --config_file examples/accelerate_config.yaml examples/train_accelerate.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_accelerate.py   # the same, without accelerate launch

``ds_ulysses.install()`` before the Accelerator is built is the only SP-specific line. The DataLoader
must be prepared in the same ``accelerator.prepare`` call as the model: Accelerate then hands it back
wrapped, and each rank's batches are its shards of the SP group's samples (``model(**batch).loss`` is
the sample's token-mean loss, the same on every SP rank). Evaluation runs without SP on whole samples:
prepare an eval DataLoader in a call of its own.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

import ds_ulysses
from ds_ulysses.train.corpus import PackedSamples, load_tokenizer, stdlib_texts
from ds_ulysses.train.recipe import build_model, set_cpu_threads

DS_CONFIG = "examples/ds_config_accelerate.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", help=f"DeepSpeed config file when not launched by accelerate launch "
                   f"(default: {DS_CONFIG})")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    ds_ulysses.install()  # before the Accelerator
    set_cpu_threads()
    if not torch.cuda.is_available():
        from cpu_gloo import report_gloo_world

        report_gloo_world()
    tokenizer = load_tokenizer(None)
    model = build_model(None, tokenizer)
    # accelerate launch passes its DeepSpeed config through the environment; otherwise name it here
    by_accelerate = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and args.deepspeed_config is None
    plugin = None if by_accelerate else DeepSpeedPlugin(hf_ds_config=args.deepspeed_config or DS_CONFIG)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    data = PackedSamples(stdlib_texts, tokenizer, args.seq_len, 2 + accelerator.num_processes * args.steps)
    train = torch.utils.data.DataLoader(data.subset(2), batch_size=1)
    held_out = torch.utils.data.DataLoader(data.subset(0, 2), batch_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    held_out = accelerator.prepare(held_out)  # its own call: not sharded, evaluated without SP

    model.train()
    for step, batch in zip(range(1, args.steps + 1), train):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        losses = [accelerator.gather(model(**batch).loss[None]) for batch in held_out]
    accelerator.print(f"sp={accelerator.parallelism_config.sp_size}: eval loss {torch.cat(losses).mean().item():.4f}")


if __name__ == "__main__":
    main()
