"""Rank functions for the Trainer and Accelerate tests: real training loops vs plain torch on one process.

The reference is independent of Transformers' Trainer, Accelerate and DeepSpeed: the same model and
samples in the same order, plain ``loss.backward()`` and SGD (no momentum, no clipping, where a
constant factor on the gradient shows at once, unlike Adam). What the SP runs must reproduce: every
step's loss and the total parameter update (``lr x`` the sum of the gradients).
"""

from __future__ import annotations

import torch

from tests.support.models import VOCAB, rel_err, tiny_config, tiny_model

LR = 0.5
SEQ = 16


def samples(n: int, length: int = SEQ, seed: int = 0, prompts: bool = False) -> list[dict]:
    """``n`` samples of ``length`` tokens; labels are the ids (the model shifts them). ``prompts``: each
    sample's first 1 to ``length - 3`` labels are -100 (an SFT prompt), so samples differ in labelled tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        labels = ids.clone()
        if prompts:
            labels[:int(torch.randint(1, length - 2, (1,), generator=g))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def documents(n: int, seed: int = 0) -> list[dict]:
    """``n`` documents of 3 to 19 tokens (lists, as a tokenized dataset holds them), each with a -100 prompt
    of 0 to length - 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length - 1, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _labelled(sample: dict) -> int:
    return int((sample["labels"][1:] != -100).sum())


def reference(data: list[dict], steps: int, eval_data: list[dict] | None = None, window: int = 1,
              groups: int = 1, heads: tuple[int, int] = (4, 2)) -> dict:
    """One process, no SP: SGD, step k on the ``window`` samples from ``k * window``; per-step losses, final
    parameters, and the mean per-sample loss on ``eval_data`` after training. The step's loss is the token
    mean over each of ``groups`` consecutive equal groups of its samples (a DP replica's share of the step),
    averaged over the groups: ``groups=1`` is the window's token mean, ``groups=window`` the mean of the
    samples' means. ``heads``: the tiny Llama's query and KV heads."""
    model = tiny_model(tiny_config("llama", heads=heads[0], kv_heads=heads[1]))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    size = window // groups
    for k in range(steps):
        step = data[k * window:(k + 1) * window]
        loss = 0.0
        for g in range(groups):
            group = step[g * size:(g + 1) * size]
            tokens = sum(_labelled(s) for s in group)
            for sample in group:
                part = model(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).loss
                part = part * _labelled(sample) / (tokens * groups)
                part.backward()
                loss += part.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    out = {"losses": losses, "start": start, "update": {n: p.detach() - start[n] for n, p in model.named_parameters()},
           "model": model}
    if eval_data is not None:
        with torch.no_grad():
            out["eval_loss"] = sum(model(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss.item()
                                   for s in eval_data) / len(eval_data)
    return out


def ds_config(stage: int, section: dict | None = None) -> dict:
    """A DeepSpeed config as a Trainer user writes it ("auto" where the Trainer fills in)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero}
    if section is not None:
        config["ulysses"] = {"tiled_loss": {"enabled": False}, **section}
    return config


def full_params(engine) -> dict:
    """Every parameter of a DeepSpeed engine's module, whole (ZeRO-1/2/3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def compare(result: dict, ref: dict) -> dict:
    """Worst per-step loss and per-parameter update relative errors of ``result`` against ``ref`` (both
    start from the same initial weights: the update is ``lr x`` the sum of the gradients)."""
    steps = len(result["losses"])
    loss = max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(result["losses"], ref["losses"][:steps]))
    floor = 1e-5 * torch.stack([u.norm() for u in ref["update"].values()]).norm().item()
    update = max(rel_err(result["params"][n] - start, ref["update"][n], floor) for n, start in ref["start"].items())
    return {"loss": loss, "update": update}


def trainer_run(rank: int, world_size: int, stage: int, switch: str, out_dir: str, steps: int = 3,
                evaluate: bool = False, save: bool = False, resume_from: str | None = None,
                save_steps: int = 0, *, sp: int | None = None, gas: int = 1, average_tokens: bool = True,
                prompts: bool = False, packed: bool = False, moe: bool = False, section_extra: dict | None = None,
                checkpointing: bool = False, heads: tuple[int, int] = (4, 2)) -> dict:
    """A real Trainer with SP at ``sp`` (the world size by default), switched on by ``switch``: "section"
    (the DeepSpeed config's "ulysses" section), "parallelism_config" (Transformers' documented path),
    "both", or "none" (the same Trainer without SP); ``gas`` micro-batches per step, ``average_tokens`` its
    ``average_tokens_across_devices``, ``prompts`` samples with -100 prompts (see :func:`samples`),
    ``packed`` micro-batches of 3 :func:`documents` packed by Transformers' padding-free
    ``DataCollatorWithFlattening`` (position_ids restart per document), ``moe`` a tiny Mixtral training its
    router load-balancing loss (:func:`moe_model`) instead of Llama, ``section_extra`` more fields of the
    section (tiled attention, say), ``checkpointing`` the Trainer's gradient checkpointing, ``heads`` the tiny Llama's
    query and KV heads. Returns the losses
    ``compute_loss`` gave, the losses the Trainer logged per step, and the final parameters. Leaves ds_ulysses
    installed (a second Trainer in the process registers over the first; the caller uninstalls). ``logits``: per
    training forward, whether the model returned logits (the tiled loss returns none); ``tiled_blocks``: the
    attention blocks that run tiled."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    ds_ulysses.install()
    # built before TrainingArguments: with a ZeRO-3 config they make from_config partition at construction
    # (zero.Init), which initialises the weights differently from the reference
    model = moe_model() if moe else tiny_model(tiny_config("llama", heads=heads[0], kv_heads=heads[1]))
    model.eval()  # as from_pretrained leaves it: the Trainer switches to train mode in its first training_step
    sp = sp or world_size
    section = {"sequence_parallel_size": sp, **(section_extra or {})} if switch in ("section", "both") else None
    pc = (ParallelismConfig(sp_backend="deepspeed", sp_size=sp)
          if switch in ("parallelism_config", "both") else None)
    micro = 3 if packed else 1
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=micro, per_device_eval_batch_size=1, max_steps=steps,
        gradient_accumulation_steps=gas, average_tokens_across_devices=average_tokens,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, train_sampling_strategy="sequential", deepspeed=ds_config(stage, section),
        parallelism_config=pc, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=checkpointing)
    losses, logits = [], []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            if model.training:
                losses.append(float(loss.detach()))
                logits.append(getattr(outputs, "logits", None) is not None)
            return (loss, outputs) if return_outputs else loss

    micro_batches = 2 * steps * gas * world_size // sp
    data = documents(micro * micro_batches) if packed else samples(micro_batches, prompts=prompts)
    trainer = Recording(model=model, args=args, train_dataset=data, eval_dataset=samples(4, seed=1),
                        data_collator=DataCollatorWithFlattening() if packed else None)
    trainer.train(resume_from_checkpoint=resume_from)
    out = {"losses": losses, "logits": logits, "logged": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "params": full_params(trainer.model_wrapped),
           "sp": getattr(trainer.accelerator.parallelism_config, "sp_size", 1),
           "ring": getattr(getattr(trainer.model_wrapped, "mpu", None), "ring_size", 1),
           "tiled_blocks": sum("_ds_ulysses_head_groups" in vars(m) for m in trainer.model_wrapped.module.modules())}
    if evaluate:
        out["eval_loss"] = trainer.evaluate()["eval_loss"]
    if save:
        trainer.save_model(f"{out_dir}/final")
    return out


def moe_model():
    """A tiny Mixtral (4 experts, top 2) whose loss adds its router load-balancing loss at weight 0.5."""
    return tiny_model(tiny_config("mixtral", heads=4, kv_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                  output_router_logits=True, router_aux_loss_coef=0.5))


def trainer_router_loss(rank: int, world_size: int, switch: str, out_dir: str) -> dict:
    """:func:`moe_model` at ZeRO-3, 2 steps of 2 micro-batches of samples with -100 prompts, at dp 2 x sp 2
    (``switch`` "section") or at dp 2 without SP ("none", 2 ranks); the run's result."""
    import ds_ulysses

    run = trainer_run(rank, world_size, 3, switch, out_dir, steps=2, sp=2, gas=2, prompts=True, moe=True)
    ds_ulysses.uninstall()
    return run


def trainer_resume(rank: int, world_size: int, stage: int, out_dir: str) -> dict:
    """4 steps with a checkpoint at step 2, then a second Trainer in the same process resuming from it
    (a new registration over the first one's); both runs' losses and final parameters."""
    import ds_ulysses

    whole = trainer_run(rank, world_size, stage, "section", f"{out_dir}/whole", steps=4, save_steps=2)
    resumed = trainer_run(rank, world_size, stage, "section", f"{out_dir}/resumed", steps=4,
                          resume_from=f"{out_dir}/whole/checkpoint-2")
    ds_ulysses.uninstall()
    return {"whole": whole, "resumed": resumed}


def trainer_token_weighting(rank: int, world_size: int, out_dir: str) -> dict:
    """Two Trainers at dp 2 x sp 2, 2 micro-batches per step of samples with -100 prompts: ZeRO-1 with
    ``average_tokens_across_devices`` False, then ZeRO-3 with True (in this order, so the ZeRO-3 Trainer's
    zero.Init never builds the other's model). Each run's result, by that flag."""
    import ds_ulysses

    runs = {average: trainer_run(rank, world_size, stage, "section", f"{out_dir}/{stage}", steps=2, sp=2, gas=2,
                                 average_tokens=average, prompts=True)
            for stage, average in ((1, False), (3, True))}
    ds_ulysses.uninstall()
    return runs


def trainer_packed(rank: int, world_size: int, switch: str, out_dir: str) -> dict:
    """Packed SFT at ZeRO-3, 2 micro-batches of 3 documents per step, at sp = world size (``switch`` "none":
    without SP)."""
    import ds_ulysses

    run = trainer_run(rank, world_size, 3, switch, out_dir, steps=2, gas=2, packed=True)
    ds_ulysses.uninstall()
    return run


def trainer_refusals(rank: int, world_size: int, out_dir: str) -> dict:
    """What used to train plain data parallelism or be refused: ``install()`` called after the Trainer was
    built (its loader is never wrapped), and the two switches disagreeing; what the SP loss would drop:
    label smoothing and a ``compute_loss_func``; a subclass whose ``compute_loss`` never calls the
    Trainer's. Returns each error message."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    errors = {}

    def trainer(parallelism_config=None, compute_loss_func=None, **args):
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, max_steps=2, optim="sgd",
                                 report_to=[], save_strategy="no", disable_tqdm=True,
                                 parallelism_config=parallelism_config,
                                 deepspeed=ds_config(2, {"sequence_parallel_size": world_size}), **args)
        return Trainer(model=tiny_model(tiny_config("llama", heads=4, kv_heads=2)), args=args,
                       train_dataset=samples(4), compute_loss_func=compute_loss_func)

    late = trainer()
    ds_ulysses.install()
    try:
        late.train()
    except ValueError as err:
        errors["install_after_trainer"] = str(err)
    flash = DeepSpeedSequenceParallelConfig(sp_attn_implementation="flash_attention_2")
    try:
        trainer(ParallelismConfig(sp_backend="deepspeed", sp_size=world_size, sp_handler=flash))
    except ValueError as err:
        errors["disagreeing_switches"] = str(err)
    for name, dropped in (("label_smoothing", trainer(label_smoothing_factor=0.1)),
                          ("compute_loss_func", trainer(compute_loss_func=lambda outputs, labels, **kw: outputs.loss))):
        try:
            dropped.train()
        except ValueError as err:
            errors[name] = str(err)

    class ShardMeanLoss(Trainer):  # its own loss: each rank's shard mean, never Trainer.compute_loss
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    own = trainer()
    own.__class__ = ShardMeanLoss
    try:
        own.train()
    except ValueError as err:
        errors["own_compute_loss"] = str(err)
    ds_ulysses.uninstall()
    return errors


def accelerate_run(rank: int, world_size: int, stage: int, switch: str, steps: int = 3,
                   eval_mode: bool = False, library: str = "ours", loss: str = "model", *,
                   section_extra: dict | None = None, heads: tuple[int, int] = (4, 2)) -> dict:
    """A plain Accelerate loop (``accelerator.prepare`` / ``accelerator.backward``) with SP from ``switch``;
    ``eval_mode`` leaves the model in eval mode through the whole loop, as a loop does that loads the model with
    ``from_pretrained`` (which returns it in eval mode) and never calls ``model.train()`` (Accelerate's ALST
    test script). ``library``
    "deepspeed" runs DeepSpeed's module (no ``install()``; ``switch`` must be "parallelism_config").
    ``loss`` "model" takes ``model(**batch).loss``; "example" is the loop Accelerate's ALST example and
    DeepSpeed's tutorial write for DeepSpeed's module: the model's loss function on this rank's
    ``logits`` and ``shift_labels``, weighted across the SP group by valid-token counts through a
    differentiable all-gather (``model_losses``: what ``model(**batch).loss`` was beside it). ``trims``: the heap
    trims the engine ran after its steps (``trim_host_heap``). ``section_extra``: more fields of the section (a
    ring, say); ``heads``: the tiny Llama's query and KV heads."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig
    from deepspeed.utils import groups

    import ds_ulysses
    import ds_ulysses.engine as ds_engine
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    trims = []
    if library == "ours":
        ds_ulysses.install()
        trim = ds_engine.trim_host_heap

        def counted_trim():  # this process's engines call it after each step: counted, then run
            trims.append(1)
            return trim()

        ds_engine.trim_host_heap = counted_trim
    model = tiny_model(tiny_config("llama", heads=heads[0], kv_heads=heads[1]))  # before the ZeRO-3 plugin
    section = ({"sequence_parallel_size": world_size, **(section_extra or {})} if switch in ("section", "both")
               else None)
    config = {**ds_config(stage, section), "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0}
    config.pop("train_batch_size")
    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa") if library == "deepspeed" else None
    pc = (ParallelismConfig(sp_backend="deepspeed", sp_size=world_size, sp_handler=handler)
          if switch in ("parallelism_config", "both") else None)  # DeepSpeed's module needs the kernel named
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), parallelism_config=pc)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = samples(2 * steps)
    if loss == "example":  # DeepSpeed's adapter requires them
        data = [{**sample, "position_ids": torch.arange(len(sample["input_ids"]))} for sample in data]
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if eval_mode:
        model.eval()
    losses, model_losses = [], []
    group, module = groups._get_sequence_parallel_group(), accelerator.unwrap_model(model)
    for _, batch in zip(range(steps), loader):
        if loss == "example":
            shift_labels = batch["shift_labels"]
            outputs = model(**batch)
            model_losses.append(outputs.loss)
            step_loss = module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                             vocab_size=module.config.vocab_size)
            per_rank = torch.distributed.nn.functional.all_gather(step_loss, group=group)
            tokens = torch.distributed.nn.functional.all_gather((shift_labels != -100).sum(), group=group)
            step_loss = sum(l * t for l, t in zip(per_rank, tokens)) / sum(tokens)
        else:
            step_loss = model(**batch).loss
        accelerator.backward(step_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss.item())
    out = {"losses": losses, "params": full_params(model), "sp": accelerator.parallelism_config.sp_size,
           "ring": getattr(getattr(model, "mpu", None), "ring_size", 1), "loader_ring": getattr(loader, "ring_size", 1),
           "model_losses": model_losses, "trims": len(trims)}
    ds_ulysses.uninstall()
    return out


def word_tokenizer():
    """A tokenizer over the tiny vocabulary (one word per id, built here: nothing is downloaded): the TRL
    benchmark's, at :data:`VOCAB` words."""
    from benchmarks.trl_loop import word_tokenizer as words

    return words(VOCAB)


def completions(n: int, seed: int = 0) -> list[dict]:
    """``n`` tokenized prompt-completion samples of 6 to 29 tokens, as TRL's dataset preparation leaves them:
    ``input_ids`` and a ``completion_mask`` that is 0 over a prompt of 1 to length - 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 30, (1,), generator=g))
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        out.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=g).tolist(),
                    "completion_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def sft_trainer_run(rank: int, world_size: int, stage: int, out_dir: str, sp: bool, packing: bool,
                    moe: bool = False, *, ring: int = 1, heads: tuple[int, int] = (4, 2)) -> dict:
    """TRL's SFTTrainer on :func:`completions` (loss on the completions only), 2 samples per micro-batch, 2
    micro-batches per step, 2 steps: with SP at sp = world size switched on by the section (``install()``
    first), or without SP. ``packing``: TRL's best-fit packing into rows of at most 64 tokens, fed by its
    padding-free collator (one flattened row per micro-batch with varlen offsets ``cu_seq_lens_*``,
    position_ids restarting per document), LoRA adapters from PEFT on the attention and MLP projections,
    gradient checkpointing and, with SP, the tiled MLP, checkpoint offload and the tiled loss. ``moe``:
    :func:`moe_model`, whose router load-balancing loss TRL's fused head adds (TRL turns it on for a MoE
    config with a ``router_aux_loss_coef``), instead of Llama, its MoE blocks tiled under SP. Returns the
    logged losses, the trainable parameters before and after training, and the eval loss after it (the
    Trainer evaluates whole samples without SP). ``ring``: the section's ``ring_size``; ``heads``: the tiny
    Llama's query and KV heads."""
    import datasets
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    section = None
    if sp:
        ds_ulysses.install()
        section = {"sequence_parallel_size": world_size, **({"ring_size": ring} if ring > 1 else {})}
        if packing:
            section.update(tiled_mlp={"enabled": True, "shards": 2}, activation_checkpoint_offload={"enabled": True},
                           tiled_loss={"enabled": True, "shards": 2})
        if moe:  # the router logits of tiled MoE blocks
            section.update(tiled_mlp={"enabled": True, "shards": 2})
    model = moe_model() if moe else tiny_model(tiny_config("llama", heads=heads[0], kv_heads=heads[1]))
    model.eval()  # as from_pretrained leaves it: the Trainer switches to train mode in its first training_step
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                      lora_dropout=0.0, task_type="CAUSAL_LM") if packing else None
    args = SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", train_sampling_strategy="sequential",
        deepspeed=ds_config(stage, section), seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
        completion_only_loss=True, packing=packing, max_length=64 if packing else None,
        pad_to_multiple_of=world_size if sp else None, gradient_checkpointing=packing, per_device_eval_batch_size=1)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(completions(48)),
                         eval_dataset=datasets.Dataset.from_list(completions(4, seed=1)),
                         processing_class=word_tokenizer(), peft_config=lora)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    ds_ulysses.uninstall()
    params = {n: safe_get_full_fp32_param(p).detach().clone()
              for n, p in trainer.model_wrapped.module.named_parameters() if p.requires_grad}
    return {"logged": [h["loss"] for h in trainer.state.log_history if "loss" in h], "start": start,
            "params": params, "eval_loss": eval_loss}


def dpo_trainer_refused(rank: int, world_size: int, out_dir: str) -> str:
    """TRL's DPOTrainer with SP at sp = world size, switched on by the section: its loss is per sample (a
    sum of the completion's log-probabilities against a reference model's), computed in its own
    ``compute_loss``, which never calls the Trainer's. Returns the error ``train()`` raised."""
    import copy

    import datasets
    from trl import DPOConfig, DPOTrainer

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world

    report_gloo_world()
    ds_ulysses.install()
    g = torch.Generator().manual_seed(0)

    def words(low: int, high: int) -> str:
        length = int(torch.randint(low, high, (1,), generator=g))
        return "".join(f" t{i}" for i in torch.randint(3, VOCAB, (length,), generator=g).tolist())

    pairs = [{"prompt": words(3, 12), "chosen": words(2, 15), "rejected": words(2, 15)} for _ in range(8)]
    model = tiny_model(tiny_config("llama", heads=4, kv_heads=2))
    args = DPOConfig(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, learning_rate=LR, optim="sgd",
                     report_to=[], save_strategy="no", disable_tqdm=True, bf16=False, max_length=None,
                     pad_to_multiple_of=world_size,
                     deepspeed=ds_config(1, {"sequence_parallel_size": world_size}))
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                         train_dataset=datasets.Dataset.from_list(pairs), processing_class=word_tokenizer())
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    finally:
        ds_ulysses.uninstall()
    return "trained"
