"""The engine hook: a DeepSpeed config's ``"ulysses"`` section -> mesh, SP model, loader, engine.

:func:`initialize` is ``deepspeed.initialize`` plus the wiring users otherwise do by hand (and get
wrong: DeepSpeed #7458, #7672, #7695): the ``(dp, sp)`` mesh is built and handed to DeepSpeed as its
``mpu`` (so ZeRO reduces gradients over SP peers too, DeepSpeed #6868), the model gets the SP
attention, the SP loss, and the section's tiling and offload switches, the training data comes back
already wrapped by the SP adapter, and each ``engine.step()`` gives the host heap's free pages back to
the OS (``trim_host_heap``, :mod:`ds_ulysses.memory.host`), and ``engine.load_checkpoint`` loads a
checkpoint written at another world size (:mod:`ds_ulysses.reshard`). :func:`install` makes a plain
``deepspeed.initialize`` (as HF Trainer, Accelerate and existing scripts call it) do the same when the
config has the section, and makes Accelerate's and the Trainer's own SP path (``parallelism_config``)
run this package (:mod:`ds_ulysses.hf.trainer`): the two switches are one. Under SP, every forward
checks that each rank's input is its shard of the group's sample (:mod:`ds_ulysses.sp.shards`): a
loader that was never wrapped fails on every rank instead of training plain data parallelism.

Failure handling: every rank checks that all ranks hold the same section and model layout before
any SP group exists (a rank with another sp would build other groups and hang the rest);
``comm_timeout_seconds`` bounds the SP groups and, when this hook starts torch.distributed, the
world group DeepSpeed reduces over; and a collective failing inside the engine's forward, backward
or step is re-raised naming the SP group and the step (:mod:`ds_ulysses.distributed.watch`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json

import torch
import torch.distributed as dist

from .config import UlyssesConfig, parse_ds_config
from .distributed.collectives import collective_device
from .distributed.mesh import Mesh, check_mesh_param, mesh_shape
from .distributed.watch import GroupWatch
from .hf.attention_tiling import apply_attention_tiling, plan_attention_tiling
from .hf.norm_tiling import tile_norms
from .hf.checkpointing import check_checkpoint_offload, enable_activation_checkpoint_offload
from .hf.loss import enable_sp_loss, tiled_causal_lm_loss
from .hf.model_facts import layout_facts, text_config, vocab_size
from .hf.register import UlyssesSPAttentionHF, register_with_transformers, resolve_ring, sp_attention_of
from .hf.router_loss import router_logits_tiles
from .hf.servable import check_model_servable, decoder_of
from .hf.trainer import install_accelerate
from .memory.host import trim_host_heap
from .memory.mlp_tiling import mlp_modules, tile_mlps
from .patching import PATCHES
from .reshard import load_on_any_mesh
from .sp.data import UlyssesSPDataLoaderAdapter
from .sp.shards import SHARDS

__all__ = ["initialize", "install", "uninstall", "prepare_model", "loss_grad_scale"]

_TAG = "install"


def loss_grad_scale(ds_config: dict, sp: int) -> float:
    """How the SP loss must scale its backward so DeepSpeed's reduction yields the non-SP gradient.

    ZeRO-3's reduce-scatter averages gradients over all sp x dp ranks; ZeRO-0/1/2 divide by dp only,
    i.e. sum over SP peers. ZeRO-3 with ``reduce_scatter: false`` does either, bucket by bucket: DeepSpeed
    0.19 divides a contiguous bucket within ``reduce_bucket_size`` by dp and averages any other (with
    ``contiguous_gradients: false``, or holding a parameter larger than the bucket size, as a large
    vocabulary's embedding is) over sp x dp, so under SP no one scale is right: refused.
    """
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) != 3:
        return 1.0
    if sp > 1 and not zero.get("reduce_scatter", True):
        raise ValueError(
            f"ZeRO-3 with \"reduce_scatter\": false cannot train exactly under SP (sp={sp}): DeepSpeed then divides a "
            "contiguous gradient bucket within reduce_bucket_size by dp but averages any other bucket over sp x dp "
            "(contiguous_gradients false, or a parameter larger than reduce_bucket_size, such as a large "
            f"vocabulary's embedding), so those gradients would be 1/{sp} of their non-SP value; expected ZeRO-3's "
            "reduce-scatter, which averages every gradient alike; fix: drop \"reduce_scatter\": false from "
            "zero_optimization (or use ZeRO stage 2)")
    return float(sp)


def check_gradient_predivide(ds_config: dict, sp: int, world_size: int) -> None:
    """ZeRO-1/2 without reduce-scatter, a ``gradient_predivide_factor`` equal to the world size, under SP, is
    refused: DeepSpeed 0.19 divides by the factor before its all-reduce and multiplies by factor / (world / sp)
    after it, but skips that multiply when the factor equals the world size, so every gradient would be 1/sp
    of its non-SP value. (ZeRO-0 compares the factor with world / sp and is exact; ZeRO-1/2 with
    reduce-scatter and ZeRO-3 reject any factor but 1 themselves.)"""
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    factor = ds_config.get("gradient_predivide_factor", 1.0)
    if (sp == 1 or stage not in (1, 2) or zero.get("reduce_scatter", True) or ds_config.get("prescale_gradients")
            or factor != world_size):
        return
    raise ValueError(
        f"gradient_predivide_factor={factor} equals the world size ({world_size}) at ZeRO stage {stage} with "
        "\"reduce_scatter\": false: DeepSpeed then skips the multiply after its all-reduce, though under SP it "
        f"should multiply by factor / (world / sp) = {factor / (world_size // sp):g}, so every gradient would be "
        f"1/{sp} of its non-SP value; expected any other factor; fix: leave gradient_predivide_factor at 1.0 (the "
        "default) or drop \"reduce_scatter\": false")


def check_fp16_loss_scaling(ds_config: dict) -> None:
    """fp16 at ZeRO stage 0 with a loss scale other than 1 is refused: DeepSpeed 0.19's ``engine.backward``
    scales the loss only for its ZeRO optimizers, while the fp16 optimizer that stage 0 gets divides the
    gradients by the loss scale in ``step()`` (DeepSpeed PR #8393, open), so every update would be
    1/loss_scale of the gradient's, with or without SP. A static ``"loss_scale": 1`` divides by 1 and is
    exact; ZeRO stages 1-3 scale the loss and are exact."""
    fp16 = ds_config.get("fp16") or {}
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    scale = fp16.get("loss_scale", 0)  # 0: dynamic, starting at 2 ** initial_scale_power
    if fp16.get("enabled") is not True or stage != 0 or scale == 1:
        return
    what = "a dynamic loss scale" if scale == 0 else f"a static loss_scale of {scale}"
    raise ValueError(
        f"fp16 with {what} at ZeRO stage 0 would train with every update 1/loss_scale of its gradient: DeepSpeed's "
        "engine.backward does not scale the loss at stage 0, yet its fp16 optimizer divides the gradients by the "
        "loss scale in step() (DeepSpeed PR #8393); expected bf16, or fp16 at ZeRO stage 1-3, or fp16 with "
        "\"loss_scale\": 1; fix: set \"bf16\": {\"enabled\": true} instead of fp16, or "
        "\"zero_optimization\": {\"stage\": 1} (or 2, 3)")


def prepare_model(model, section: UlyssesConfig, mesh: Mesh, micro_batch_size: int, grad_scale: float) -> None:
    """Apply the section to ``model``: SP attention, SP loss (tiled or not), tiled MLP, attention and norms,
    offload.

    A model whose attention a registration on this mesh already serves (Accelerate registers before
    it calls ``deepspeed.initialize``) keeps it. From here on its SP forwards must get the data
    adapter's shards.
    """
    if section.tiled_mlp.enabled:  # refusals first, before anything changes
        router_side = _router_side(model)
        _require_mlps(model)
    if section.tiled_attention.enabled:
        if mesh.sp > 1:  # a model SP cannot serve is refused for that, not for its attention blocks' layout
            check_model_servable(model.config, model)
        attention_plans = plan_attention_tiling(model, mesh.ulysses_size, section.tiled_attention.shards)
    if section.activation_checkpoint_offload.enabled:
        check_checkpoint_offload(model)
    if mesh.sp > 1:
        served = sp_attention_of(model)
        if served is None:
            register_with_transformers(model, section.attn_implementation, mesh.sp, micro_batch_size,
                                       section.seq_length, section.seq_length_is_variable,
                                       section.disable_in_eval, mesh=mesh, scope="model")
        elif served.process_group is not mesh.ulysses_group:
            raise ValueError(
                f"{type(model).__name__}'s attention is already registered for Ulysses SP on another SP group "
                f"(ranks {served.watch.ranks}) than this engine's mesh {mesh}; expected one registration per model; "
                "fix: pass that registration's mpu to initialize (or drop the earlier register_with_transformers call)")
        else:  # registered by name before it was built: the wrapper it came in (PEFT's) is seen only here
            check_model_servable(model.config, model)
        SHARDS.require(mesh.sp_group)
        PATCHES.on_undo(functools.partial(SHARDS.release, mesh.sp_group), "sp_inputs", owner=model)
    if section.model_loss:
        loss_fn = tiled_causal_lm_loss(section.tiled_loss.shards, mesh.sp_watch) if section.tiled_loss.enabled else None
        enable_sp_loss(model, mesh.sp_group, grad_scale, loss_fn, watch=mesh.sp_watch)
    if section.tiled_mlp.enabled:
        tile_mlps(model, section.tiled_mlp.shards, router_side)
    if section.tiled_attention.enabled:
        apply_attention_tiling(attention_plans)
    if section.tiled_norms.enabled:
        tile_norms(model)
    if section.activation_checkpoint_offload.enabled:
        enable_activation_checkpoint_offload(model, section.activation_checkpoint_offload.layers)


def _require_mlps(model) -> None:
    """A ``tiled_mlp`` section needs MLPs to tile. A decoder whose feed-forward is not named ``mlp``
    (GraniteMoE's ``block_sparse_moe``, OPT's ``fc1``/``fc2``, Llama 4's ``feed_forward``) would train
    with the switch on and nothing tiled, its MLP activations whole: refused before anything changes."""
    decoder = decoder_of(model)
    if mlp_modules(decoder):
        return
    layer = next((m[0] for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
    parts = ", ".join(name for name, _ in layer.named_children()) if layer is not None else "no layer list found"
    raise ValueError(
        f"tiled_mlp is enabled but {type(model).__name__}'s decoder has no module named 'mlp' to tile (its first "
        f"layer holds: {parts}), so it would train with every MLP untiled; expected decoder MLPs named 'mlp', "
        "which tile_mlps runs through TiledMLP; fix: set \"tiled_mlp\": {\"enabled\": false}, or tile the "
        "feed-forward yourself with ds_ulysses.TiledMLP or sequence_tiled_compute")


def _router_side(model):
    """What TiledMLP needs to serve a MoE model's router logits (:func:`router_logits_tiles`; None for a model
    whose config has no ``output_router_logits``); a model that trains its router loss on a Transformers without
    it is refused before anything changes: TiledMLP runs each MoE block without autograd, so the loss would
    train nothing."""
    if not hasattr(text_config(model), "output_router_logits"):
        return None
    side = router_logits_tiles()
    if side is None and text_config(model).output_router_logits:
        raise ValueError(
            f"tiled_mlp cannot serve {type(model).__name__} with output_router_logits=True on this Transformers: it "
            "records router logits without the output-capturing collector TiledMLP hands their gradient through, so "
            "the load-balancing loss would train nothing; expected Transformers 5 (its "
            "transformers.utils.output_capturing); fix: set \"tiled_mlp\": {\"enabled\": false}, or set "
            "config.output_router_logits = False (in TRL's SFTConfig, router_aux_loss_coef=0.0)")
    return side


def _refuse_leaves_inside_mlps(model) -> None:
    """Under ZeRO-3 a leaf module (DeepSpeed's ``zero_optimization.leaf_module``, ``set_z3_leaf_modules``)
    has its parameters' gradients reduced from its own backward hook, not one per parameter. Inside a tiled
    MLP that hook runs in every tile's recompute, before the tiles' gradients are summed, so DeepSpeed
    reduces each of the leaf's parameters once per tile (LongCat-Flash's experts: its duplicate-parameter
    check failed in backward): refused. An MLP that is itself the leaf (DeepSpeed's default for Mixtral's
    and Qwen-MoE's blocks) is served: its hook runs once, after the tiles."""
    from deepspeed.utils import z3_leaf_module

    for mlp_name, mlp in mlp_modules(model):
        inner = next(((n, m) for n, m in mlp.named_modules() if n and z3_leaf_module(m)), None)
        if inner is not None:
            raise ValueError(
                f"tiled_mlp cannot serve {mlp_name} ({type(mlp).__name__}) under ZeRO-3: it holds the leaf module "
                f"{inner[0]} ({type(inner[1]).__name__}), whose gradients DeepSpeed would reduce in every tile's "
                f"recompute instead of once; expected the tiled MLP itself as the leaf, or no leaf inside it; fix: "
                f"make the block the leaf (\"zero_optimization\": {{\"leaf_module\": {{\"classes\": "
                f"[\"{type(mlp).__name__}\"]}}}}, or deepspeed.utils.set_z3_leaf_modules(model, "
                f"[\"{type(mlp).__name__}\"])), or set \"tiled_mlp\": {{\"enabled\": false}}")


def _sp_loader(training_data, mesh: Mesh, section: UlyssesConfig, micro_batch_size: int, collate_fn,
               vocab_size: int | None = None):
    """Every rank reads a distinct 1/world of the data; its SP group then trains on each sample once."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=mesh.world_size, rank=mesh.rank,
                                 shuffle=False, drop_last=True)
    loader = DataLoader(training_data, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn)
    return UlyssesSPDataLoaderAdapter(loader, mesh.sp_rank, mesh.sp_group, mesh.sp, collective_device(mesh.sp_group),
                                      pad_to_multiple=section.pad_to_multiple, pad_token_id=section.pad_token_id,
                                      vocab_size=vocab_size, watch=mesh.sp_watch, ring_size=mesh.ring_size)


def _check_ranks_agree(section: UlyssesConfig, model) -> None:
    """Every rank must hold the same section (so the same mesh) and model layout before any SP group exists.

    One all_gather of an 8-byte digest over the world; a disagreement raises the same error on
    every rank, naming which ranks hold which version.
    """
    facts = {"ulysses": section.to_dict(), "model": layout_facts(model)}
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.long,
                        device=collective_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    versions: dict[int, list[int]] = {}
    for rank, value in enumerate(every):
        versions.setdefault(int(value), []).append(rank)
    if len(versions) > 1:
        groups = " vs ".join(str(ranks) for ranks in versions.values())
        raise ValueError(
            f"ranks disagree on the \"ulysses\" section or the model's layout: ranks {groups} hold "
            "different versions; expected every rank to load the same DeepSpeed config and the same model "
            "(a rank with another sp or head count would build other groups and hang the rest); fix: pass "
            "every rank the same config file and checkpoint")


def _reuse_mesh(mpu: Mesh, dp: int, sp: int, ring: int) -> Mesh:
    """The mesh a registration built (Accelerate passes it as ``mpu``), if it is the section's."""
    if (mpu.dp, mpu.sp) != (dp, sp):
        raise ValueError(
            f"the mpu passed to deepspeed.initialize is a ds_ulysses mesh of dp={mpu.dp} x sp={mpu.sp}, but the "
            f"\"ulysses\" section gives dp={dp} x sp={sp}; expected one SP size (Accelerate's parallelism_config "
            "sp_size, or the sp of register_with_transformers, and the section's); fix: make them equal")
    if mpu.ring_size != ring:
        raise ValueError(
            f"the mpu passed to deepspeed.initialize is a ds_ulysses mesh with ring_size={mpu.ring_size}, but the "
            f"\"ulysses\" section gives ring_size={ring}; expected one ring (DeepSpeed's "
            "register_with_transformers call, made without ring_size, registers none); fix: pass the section's "
            "ring_size to register_with_transformers(..., ring_size=...), call ds_ulysses.initialize without an mpu, "
            "or set ring_size to 1")
    return mpu


def _fit_train_batch_size(ds_config: dict, mesh: Mesh) -> None:
    """DeepSpeed checks train_batch_size == micro x gas x dp; under SP dp is world / sp (an SP group
    trains on one micro-batch at a time). A value filled in for a world of plain data parallelism (what
    frameworks do) is resized; any other mismatch is refused here, naming the numbers."""
    micro, gas, train = (ds_config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                    "train_batch_size"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (micro, gas, train)):
        return
    want = micro * gas * mesh.dp
    if train == micro * gas * mesh.world_size:
        ds_config["train_batch_size"] = want
    elif train != want:
        raise ValueError(
            f"train_batch_size={train} does not fit the SP mesh dp={mesh.dp} x sp={mesh.sp}: expected "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp = {micro} x {gas} x {mesh.dp} = {want} "
            f"(each SP group of {mesh.sp} ranks trains on one micro-batch at a time); fix: set train_batch_size to "
            f"{want} or leave it out")


def _watch_engine(engine, watch: GroupWatch) -> None:
    """Re-raise a collective failure in the engine's forward/backward/step naming group and step.

    Covers what the SP modules cannot see from inside: the backward all-to-alls and DeepSpeed's own
    gradient reductions.
    """
    for name in ("forward", "backward", "step"):
        method = getattr(engine, name)

        @functools.wraps(method)
        def watched(*args, _method=method, _what=f"engine.{name}", **kwargs):
            with watch.collective(_what):
                return _method(*args, **kwargs)

        setattr(engine, name, watched)


def _load_on_any_mesh(engine) -> None:
    """``engine.load_checkpoint`` continues a checkpoint written at another world size (HF Trainer's
    ``resume_from_checkpoint`` and Accelerate's ``load_state`` call it): converted once to DeepSpeed's
    universal form, loaded, its parameter groups repaired (:func:`ds_ulysses.reshard.load_on_any_mesh`)."""
    engine.load_checkpoint = functools.partial(load_on_any_mesh, engine, engine.load_checkpoint)


def _trim_after_step(engine) -> None:
    """Give the host heap's free pages back to the OS after each ``engine.step()``
    (``trim_host_heap``, :mod:`ds_ulysses.memory.host`): the step's freed activations then do not stay
    resident under the next step's peak."""
    step = engine.step

    @functools.wraps(step)
    def step_then_trim(*args, **kwargs):
        out = step(*args, **kwargs)
        trim_host_heap()
        return out

    engine.step = step_then_trim


def initialize(model=None, config=None, mesh_param=None, model_parameters=None, training_data=None,
               args=None, collate_fn=None, **deepspeed_kwargs):
    """``deepspeed.initialize`` with SP set up from the config's ``"ulysses"`` section.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the loader (when
    ``training_data`` is given) is an :class:`UlyssesSPDataLoaderAdapter` whose batches go straight
    into ``engine(**batch)``, whose ``.loss`` is the global token mean on every SP rank.
    ``mesh_param=(dp, sp)`` overrides the section's mesh.
    """
    import deepspeed

    ds_initialize = PATCHES.original_attr(deepspeed, "initialize")
    if config is None:
        config = deepspeed_kwargs.pop("config_params", None)
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # DeepSpeed refuses a config given twice
    ds_config, section = parse_ds_config(config if config is not None else {})
    if section is None:
        return ds_initialize(args=args, model=model, model_parameters=model_parameters, training_data=training_data,
                             config=ds_config, mesh_param=mesh_param, collate_fn=collate_fn, **deepspeed_kwargs)
    mpu = deepspeed_kwargs.pop("mpu", None)
    if mpu is not None and not isinstance(mpu, Mesh):
        raise ValueError(
            f"got both an mpu ({type(mpu).__name__}) and a \"ulysses\" config section; the section builds the "
            "mesh and its mpu itself (it reuses a ds_ulysses Mesh, what register_with_transformers returns), so "
            "drop mpu= (or drop the section and wire SP by hand)")
    if model is None:
        raise ValueError("initialize needs model=...: the ulysses section configures the model's attention and loss")
    check_fp16_loss_scaling(ds_config)
    if mesh_param is not None:
        mesh_param = check_mesh_param(mesh_param)
        section = dataclasses.replace(section, mesh_param=mesh_param, sequence_parallel_size=mesh_param[1])
    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=section.comm_timeout)
    _check_ranks_agree(section, model)
    dp, sp = mesh_shape(dist.get_world_size(), section.sp, section.mesh_param)
    grad_scale = loss_grad_scale(ds_config, sp)
    check_gradient_predivide(ds_config, sp, dp * sp)
    ring = resolve_ring(model.config, section.ring_size, sp) if sp > 1 else 1
    mesh = (_reuse_mesh(mpu, dp, sp, ring) if mpu is not None
            else Mesh(dp, sp, section.comm_timeout_seconds, ring_size=ring))
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    prepare_model(model, section, mesh, micro, grad_scale)
    ds_config["sequence_parallel_size"] = sp
    _fit_train_batch_size(ds_config, mesh)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, scheduler = ds_initialize(
        args=args, model=model, model_parameters=model_parameters, config=ds_config, mpu=mesh, **deepspeed_kwargs)
    if section.tiled_mlp.enabled and engine.zero_optimization_stage() == 3:
        _refuse_leaves_inside_mlps(model)  # DeepSpeed flags its leaf modules in initialize
    _watch_engine(engine, mesh.sp_watch)
    _load_on_any_mesh(engine)
    if section.trim_host_heap:
        _trim_after_step(engine)
    loader = None
    if training_data is not None:
        loader = _sp_loader(training_data, mesh, section, micro, collate_fn, vocab_size(model))
    return engine, optimizer, loader, scheduler


def _patched_initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                        lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                        collate_fn=None, config=None, mesh_param=None, config_params=None):
    """``deepspeed.initialize`` after :func:`install`: same signature, the section honoured."""
    kwargs = dict(optimizer=optimizer, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                  dist_init_required=dist_init_required)
    return initialize(model=model, config=config if config is not None else config_params, mesh_param=mesh_param,
                      model_parameters=model_parameters, training_data=training_data, args=args,
                      collate_fn=collate_fn, **kwargs)


def install() -> None:
    """Make ``deepspeed.initialize`` honour the ``"ulysses"`` section, and Accelerate's and the Trainer's SP
    path (``parallelism_config``, DeepSpeed's ALST names) run this package. Idempotent.

    Call it before the Trainer or Accelerator is created: the section and ``parallelism_config`` are made
    one when the Accelerator is built (:func:`ds_ulysses.hf.trainer.reconcile`).
    """
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    if PATCHES.has(_TAG):
        return
    PATCHES.set_attr(deepspeed, "initialize", _patched_initialize, _TAG)
    PATCHES.set_attr(ulysses_sp, "UlyssesSPAttentionHF", UlyssesSPAttentionHF, _TAG)
    PATCHES.set_attr(ulysses_sp, "UlyssesSPDataLoaderAdapter", UlyssesSPDataLoaderAdapter, _TAG)
    install_accelerate(_TAG)


def uninstall() -> None:
    """Undo everything this package changed in the process: ``deepspeed.initialize`` and DeepSpeed's ALST
    names, Accelerate's and the Trainer's SP hooks, Transformers' attention tables, and every model it
    prepared (attention, loss, input checks, tiled MLPs, checkpoint offload). Idempotent."""
    PATCHES.undo()
