"""The training job behind ``examples/train.py``: a causal LM on long sequences with Ulysses SP, set up by
the DeepSpeed config's ``"ulysses"`` section, with checkpoints, resume and the held-out evaluation.

With no --data it trains on the Python standard library's source (bytes, packed into --seq-len
documents) with a tiny Llama; it prints a line per step, saves a checkpoint every --save-every steps
under OUT/checkpoints (--resume continues from the latest complete one, on this mesh or another with
the same global batch: docs/resume.md), and ends with the held-out loss by token position in OUT/eval/
(CSV and PNG).
"""

import argparse
import atexit
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import deepspeed
import torch.distributed as dist

from .. import engine
from ..config import parse_ds_config
from ..distributed.mesh import mesh_shape
from . import checkpoint as ckpt
from .corpus import PackedSamples, file_texts, load_tokenizer, stdlib_texts
from .evaluate import buckets_arg, evaluate_positions
from .progress import ProgressLine
from .position import Layout, advance, continue_position, ranks, samples_needed, start_position
from .recipe import build_model, set_cpu_threads
from .universal import ensure_universal, launch_world_size, restore_param_groups

__all__ = ["parse_args", "train", "main", "leave"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed config with a \"ulysses\" section")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per sample (the whole sequence, all SP ranks)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to train up to")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps and at the end (0: never)")
    p.add_argument("--out", default="runs/train", help="run directory: checkpoints/ and eval/")
    p.add_argument("--resume", nargs="?", const="", metavar="CHECKPOINT",
                   help="continue from CHECKPOINT, or without a value from OUT/checkpoints' latest complete one; "
                        "any mesh with the checkpoint's global batch continues it exactly (docs/resume.md)")
    p.add_argument("--allow-batch-change", action="store_true",
                   help="resume with another global batch (dp x micro batch x accumulation): a new trajectory")
    p.add_argument("--data", nargs="+", metavar="FILE", help="text or JSONL (\"text\" field) files; default: stdlib")
    p.add_argument("--tokenizer", help="local HF tokenizer directory; default: bytes")
    p.add_argument("--model", help="local HF model directory; default: a tiny Llama built from config")
    p.add_argument("--eval-samples", type=int,
                   help="held-out sequences for loss by position (default: world size; a resume: the checkpoint's)")
    p.add_argument("--buckets", type=buckets_arg, default="log2", help="evaluation buckets: log2, or N positions each")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _resume_position(manifest, directory, layout: Layout, args) -> dict:
    """Where this job's data continues the checkpoint's; raises when it cannot continue exactly.

    The held-out count is the checkpoint's (the evaluation set and where training data starts), never
    this job's world size.
    """
    held_out = manifest.data["held_out_samples"]
    if args.eval_samples is not None and args.eval_samples != held_out:
        raise ckpt.CheckpointError(
            f"held-out samples: checkpoint {directory} held out {held_out}, this job --eval-samples "
            f"{args.eval_samples}; the training stream starts after them; fix: pass --eval-samples {held_out} "
            "or drop it (a resume takes the checkpoint's)")
    return continue_position(manifest.data, Layout.of_checkpoint(manifest), layout,
                             allow_batch_change=args.allow_batch_change)


def _prepare_universal(manifest, directory, ds_config: dict, world: int):
    """The checkpoint's universal form when this job's world differs from its ZeRO partition count."""
    if manifest.zero_partitions == world:
        return None
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):
        raise ckpt.CheckpointError(
            f"checkpoint {directory} was written by {manifest.zero_partitions} ranks and this job has {world}; a resume "
            f"at another world size goes through DeepSpeed's universal checkpoint, which converts ZeRO stages 1-3, "
            f"and this config has zero_optimization.stage {stage}; fix: launch {manifest.zero_partitions} ranks "
            "(any dp x sp split) or train under ZeRO 1-3")
    return ensure_universal(directory, manifest.zero_partitions)


def _resume_line(manifest, directory, layout: Layout, position: dict, universal) -> str:
    loaded = (f"converted once to DeepSpeed's universal form ({universal.name}/) and loaded it, each optimizer "
              "group's step and hyperparameters restored" if universal is not None
              else "DeepSpeed's own load (same ZeRO partitioning)")
    return (f"resume: step {manifest.step} of {directory}, written on dp {manifest.dp} x sp {manifest.sp} "
            f"({ranks(manifest.world_size)}), continues on dp {layout.dp} x sp {layout.sp} "
            f"({ranks(layout.world_size)}): {loaded}; data continues after {position['samples_consumed']} trained "
            f"samples (global batch {position['global_batch']}, {position['held_out_samples']} held out)")


def train(argv=None) -> dict:
    args = parse_args(argv)
    set_cpu_threads()
    ds_config, section = parse_ds_config(args.deepspeed_config)
    if section is None:
        raise ValueError(f"{args.deepspeed_config}: expected a \"ulysses\" section, got none; fix: add "
                         "\"ulysses\": {\"sequence_parallel_size\": 1} (or more) next to zero_optimization")
    world = launch_world_size()
    _, sp = mesh_shape(world, section.sp, section.mesh_param)
    layout = Layout(world, sp, ds_config.get("train_micro_batch_size_per_gpu", 1),
                    ds_config.get("gradient_accumulation_steps", 1))
    start, config, manifest, resume_dir, universal = 0, args.deepspeed_config, None, None, None
    if args.resume is None:
        position = start_position(layout, world if args.eval_samples is None else args.eval_samples)
    else:  # before the process groups: a refusal comes first, and a conversion cannot hold up a collective
        resume_dir = ckpt.find_checkpoint(args.resume or f"{args.out}/checkpoints")
        manifest = ckpt.verify_checkpoint(resume_dir)
        start, position = manifest.step, _resume_position(manifest, resume_dir, layout, args)
        universal = _prepare_universal(manifest, resume_dir, ds_config, world)
    deepspeed.init_distributed()
    tokenizer = load_tokenizer(args.tokenizer)
    model = build_model(args.model, tokenizer, section.attn_implementation, args.seed)
    if manifest is not None:
        ckpt.check_compatible(manifest, resume_dir, model_hash=ckpt.model_fingerprint(model.config),
                              seq_len=args.seq_len, tokenizer=tokenizer.source)
    if universal is not None:
        config = json.loads(Path(args.deepspeed_config).read_text(encoding="utf-8"))
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    n_eval = position["held_out_samples"]

    texts = (lambda: file_texts(args.data)) if args.data else stdlib_texts
    corpus = PackedSamples(texts, tokenizer, args.seq_len, samples_needed(position, layout, max(args.steps - start, 0)))
    train_set = corpus.subset(position["sample_offset"])
    trainer, _, loader, _ = engine.initialize(model=model, config=config, training_data=train_set)
    if manifest is not None:
        ckpt.load_checkpoint(trainer, resume_dir, manifest, tag=None if universal is None else universal.name)
        if universal is not None and trainer.zero_optimization_stage() == 3:  # ZeRO-1/2's load is per group
            restore_param_groups(trainer, universal)
        for _ in range(position["skip_micro_batches"]):
            next(loader)
        if dist.get_rank() == 0:
            print(_resume_line(manifest, resume_dir, layout, position, universal), flush=True)

    progress, losses, saved = ProgressLine(args.steps), {}, None
    for step in range(start, args.steps):
        progress.start()
        total, tokens = 0.0, 0
        for _ in range(layout.grad_accum):
            batch = next(loader)
            loss = trainer(**batch).loss
            trainer.backward(loss)
            trainer.step()
            total, tokens = total + loss.item() / layout.grad_accum, tokens + batch["input_ids"].numel()
        losses[step + 1] = progress.end(step + 1, total, tokens).loss
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            saved = ckpt.save_checkpoint(
                trainer, f"{args.out}/checkpoints", step + 1, model_config=model.config, seq_len=args.seq_len,
                tokenizer=tokenizer.source, data=advance(position, layout, step + 1 - start),
                hf_tokenizer=getattr(tokenizer, "tokenizer", None))

    result = None
    if n_eval:
        result = evaluate_positions(trainer.module, corpus.subset(0, n_eval), trainer.mpu, args.buckets,
                                    pad_token_id=tokenizer.pad_id)
        if dist.get_rank() == 0:
            csv = result.write_csv(f"{args.out}/eval/loss_by_position.csv")
            png = result.plot(f"{args.out}/eval/loss_by_position.png",
                              f"held-out loss by position ({n_eval} x {args.seq_len} tokens, sp={sp})")
            print(f"eval: mean loss {result.overall:.4f} over {int(result.counts.sum())} held-out tokens "
                  f"-> {csv}, {png}" + (f"; checkpoint {saved}" if saved else ""), flush=True)
    return {"losses": losses, "engine": trainer, "checkpoint": saved, "eval": result, "eval_samples": n_eval}


def main(argv=None) -> int:
    """The script's entry: :func:`train`, then every rank leaves its process groups together.

    A process that exits with its gloo groups alive can abort at interpreter teardown ("terminate called
    without an active exception"): a gloo worker thread releasing the last collective's tensors needs
    the GIL the exiting interpreter no longer hands out (pytorch/pytorch#190489; seen here after the
    evaluation's all_reduce). The barrier waits for every earlier collective of the default group and
    releases the GIL while it waits; the groups are then shut down while the interpreter is alive.
    The script ends its process with :func:`leave`, which closes what this leaves open.
    """
    train(argv)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def leave(code: int) -> NoReturn:
    """End the script's process with ``code``: exit handlers run and the streams are flushed, but the
    interpreter is not torn down (``os._exit``).

    :func:`main` leaves its groups, yet gloo's worker threads live as long as the process group objects,
    and globals keep some of those until teardown (``deepspeed.utils.groups.mpu``, the module stack of
    ZeRO-3's hooks, the default arguments of ``torch.distributed.nn.functional``). A worker that drops
    the last reference to a collective's tensor whose Python object Python has let go of needs the GIL;
    asked for once teardown has begun, the GIL ends the thread with ``pthread_exit`` through a C++
    destructor, and the process aborts ("terminate called without an active exception"). The barrier
    and destroy in :func:`main` made that rare, not impossible: CI's launcher test still aborted once
    after them (2026-11-28). A two-rank gloo script ending without them aborted in 9 of 30 runs here,
    and in none of 30 ending with this function.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
