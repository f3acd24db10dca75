"""Rank functions for tests/integration/test_trainer_resume_mesh.py: HF Trainer and an Accelerate loop that
save at one mesh and resume at another through :func:`ds_ulysses.install` (ZeRO-3, tiny Llama, AdamW with
the Trainer's two parameter groups: weight decay 0.1 and 0.0)."""

from __future__ import annotations

import torch

from tests.support.models import tiny_config, tiny_model
from tests.support.trainer_cases import samples

LR = 1e-2
DECAY = 0.1
SAMPLES = 8  # 8 steps of global batch 1: one epoch on every mesh tested


def deepspeed_checkpoint(root, tag="global_step4", ranks=2, config=None, zero=True):
    """What DeepSpeed writes for ``ranks`` ranks: a ``latest`` file and, per rank, the model and (ZeRO)
    optimizer state files; the model states hold the config it ran with."""
    tag_dir = root / tag
    tag_dir.mkdir(parents=True)
    (root / "latest").write_text(tag)
    config = config or {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                        "sequence_parallel_size": 2}
    for rank in range(ranks):
        torch.save({"ds_config": config, "dp_world_size": ranks, "module": None},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        if zero:
            torch.save({}, tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return tag_dir


def _config(sp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
            "ulysses": {"sequence_parallel_size": sp, "tiled_loss": {"enabled": False}}}


def trainer(out_dir: str, sp: int, steps: int, *, gas: int = 1, save_steps: int = 0,
            resume_from: str | None = None) -> list[float]:
    """A Trainer at sp ``sp`` over this launch's ranks; the loss of each step it trained (``gas`` 1: one
    micro-batch per step, its SP loss the same on every rank)."""
    from transformers import Trainer, TrainingArguments

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    ds_ulysses.install()
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=4))  # before the ZeRO-3 arguments (zero.Init)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, max_steps=steps, gradient_accumulation_steps=gas,
        learning_rate=LR, optim="adamw_torch", weight_decay=DECAY, lr_scheduler_type="constant", max_grad_norm=0.0,
        logging_steps=1, report_to=[], save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        train_sampling_strategy="sequential", deepspeed=_config(sp), seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    losses = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            if model.training:
                losses.append(float(loss.detach()))
            return (loss, outputs) if return_outputs else loss

    run = Recording(model=model, args=args, train_dataset=samples(SAMPLES))
    try:
        run.train(resume_from_checkpoint=resume_from)
    finally:
        ds_ulysses.uninstall()
    return losses


def refusal(fn, *args, **kwargs) -> str | None:
    """The message of the CheckpointError ``fn`` raised, None when it raised none."""
    from ds_ulysses.reshard import CheckpointError

    try:
        fn(*args, **kwargs)
    except CheckpointError as err:
        return str(err)
    return None


def trainer_source(rank: int, world_size: int, out_dir: str) -> list[float]:
    """4 steps at dp 1 x sp 2, saved at step 4 (``out_dir/source/checkpoint-4``)."""
    return trainer(f"{out_dir}/source", 2, 4, save_steps=4)


def trainer_resumed(rank: int, world_size: int, out_dir: str) -> dict:
    """At sp ``world_size`` (dp 1, global batch 1 as the source's): an uninterrupted 8 steps, the source's
    checkpoint resumed to step 8, and a resume with 2 accumulation steps (global batch 2), refused."""
    checkpoint = f"{out_dir}/source/checkpoint-4"
    return {"whole": trainer(f"{out_dir}/whole{world_size}", world_size, 8),
            "resumed": trainer(f"{out_dir}/resumed{world_size}", world_size, 8, resume_from=checkpoint),
            "refused": refusal(trainer, f"{out_dir}/refused{world_size}", world_size, 8, gas=2,
                               resume_from=checkpoint)}


def _accelerate(sp: int, state_dir: str, *, save_at: int = 0, load: bool = False, steps: int) -> list[float]:
    """A plain Accelerate loop at sp ``sp``, AdamW with two parameter groups; the step losses of the
    samples from ``4 if load else 0`` on. ``save_at``: ``save_state`` after that many steps."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    ds_ulysses.install()
    try:
        model = tiny_model(tiny_config("llama", heads=4, kv_heads=4))
        config = {**_config(sp), "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0}
        config.pop("train_batch_size")
        AcceleratorState._reset_state()  # the Trainer's Accelerator, built before in this process
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        decay = [p for n, p in model.named_parameters() if "norm" not in n]
        no_decay = [p for n, p in model.named_parameters() if "norm" in n]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": DECAY},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=LR)
        first = 4 if load else 0
        loader = torch.utils.data.DataLoader(samples(SAMPLES)[first:], batch_size=1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if load:
            accelerator.load_state(state_dir)
        losses = []
        for step, batch in zip(range(first, steps), loader):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step + 1 == save_at:
                accelerator.save_state(state_dir)
        return losses
    finally:
        ds_ulysses.uninstall()


def accelerate_source(rank: int, world_size: int, out_dir: str) -> list[float]:
    """6 steps at dp 1 x sp 2, ``save_state`` after step 4 (``out_dir/accelerate``)."""
    return _accelerate(2, f"{out_dir}/accelerate", save_at=4, steps=6)


def accelerate_resumed(rank: int, world_size: int, out_dir: str) -> list[float]:
    """``load_state`` of the 2-rank state at sp ``world_size``, then steps 5 and 6."""
    return _accelerate(world_size, f"{out_dir}/accelerate", load=True, steps=6)


def source(rank: int, world_size: int, out_dir: str) -> dict:
    return {"trainer": trainer_source(rank, world_size, out_dir),
            "accelerate": accelerate_source(rank, world_size, out_dir)}


def resumed(rank: int, world_size: int, out_dir: str, accelerate: bool) -> dict:
    out = trainer_resumed(rank, world_size, out_dir)
    if accelerate:
        out["accelerate"] = accelerate_resumed(rank, world_size, out_dir)
    return out
