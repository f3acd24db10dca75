"""Drop-in: DeepSpeed's ALST module and ours side by side on the same inputs, call by call.

DeepSpeed is installed with us, so every case runs ``deepspeed.runtime.sequence_parallel.ulysses_sp``
and ``ds_ulysses`` on the same ranks and data and asserts equal results where DeepSpeed is right, and
the exact reference (plain torch, or the unsharded model) where it is not. DeepSpeed's own scenarios
(its ``tests/unit/ulysses_alst/test_ulysses_sp_hf.py``) are re-expressed here: a 6-token sample
sharded over 2 ranks, and a model trained one step with SP against the same model without it.
The tiled-compute half of the API is compared in tests/unit/memory.

Tolerances: the same fp32 ops in a different order (all-to-all layouts), so 1e-6 relative for
activations; losses and gradients through ZeRO 1e-5 / 1e-4 as everywhere in this suite.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

import ds_ulysses
from ds_ulysses.hf import register as register_module
from tests.support.distributed import run_distributed
from tests.support.engine_cases import full_fp32_param
from tests.support.models import rel_err, tiny_config, tiny_model

pytestmark = pytest.mark.slow


def _both():
    """Both modules, with DeepSpeed's comm layer attached to the ranks' process group (its module talks
    through deepspeed.comm)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    deepspeed.init_distributed(dist_backend="gloo")
    return {"deepspeed": ulysses_sp, "ours": ds_ulysses}


def _sample_loader():
    """DeepSpeed's test data: two 6-token samples with labels and positions, batch size 1."""
    ids = torch.tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    data = torch.utils.data.TensorDataset(ids, torch.arange(6).expand(2, 6))

    def collate(batch):
        input_ids, position_ids = batch[0]
        return {"input_ids": input_ids[None], "position_ids": position_ids[None], "labels": input_ids[None],
                "source": "doc"}

    return torch.utils.data.DataLoader(data, batch_size=1, collate_fn=collate)


def _adapters(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    out = {}
    for name, module in _both().items():
        adapter = module.UlyssesSPDataLoaderAdapter(_sample_loader(), sp_rank=rank, sp_group=group,
                                                    sp_world_size=world_size, device="cpu")
        out[name] = {"len": len(adapter), "batches": list(adapter)}
    return out


def test_the_adapter_yields_deepspeed_s_micro_batches():
    for rank, res in enumerate(run_distributed(_adapters, 2)):
        ds, ours = res["deepspeed"], res["ours"]
        assert ours["len"] == ds["len"] == 4
        assert len(ours["batches"]) == len(ds["batches"]) == 4
        for got, want in zip(ours["batches"], ds["batches"]):
            assert list(got) == list(want)
            for key, value in want.items():
                assert torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value, key
        first = ours["batches"][0]  # DeepSpeed's golden shards of sample 0
        assert first["input_ids"].tolist() == [[[1, 10, 10], [10, 2, 2]][rank]]
        assert first["shift_labels"].tolist() == [[[10, 10, 10], [2, 2, -100]][rank]]


def _attention(rank, world_size, packed):
    """One attention call of each wrapper around Transformers' sdpa on the same q/k/v shards; the exact
    reference is plain sdpa on the whole sequence with the causal (per-document) mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bs, hc, hc_kv, sl, hs = 2, 4, 2, 12, 8
    sl_l = sl // world_size
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bs, h, sl, hs, generator=g, dtype=torch.float64) for h in (hc, hc_kv, hc_kv))
    positions = (torch.cat([torch.arange(5), torch.arange(7)]) if packed else torch.arange(sl)).expand(bs, sl)
    doc = torch.cat([torch.zeros(5), torch.ones(7)]) if packed else torch.zeros(sl)
    i = torch.arange(sl)
    mask = (i[:, None] >= i[None, :]) & (doc[:, None] == doc[None, :])
    ref_k, ref_v = (x.repeat_interleave(hc // hc_kv, 1) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q, ref_k, ref_v, attn_mask=mask).transpose(1, 2)
    mine = slice(rank * sl_l, (rank + 1) * sl_l)

    class Attention(torch.nn.Module):
        is_causal, num_key_value_groups, layer_idx = True, hc // hc_kv, 0

    group = dist.new_group(list(range(world_size)))
    out = {}
    for name, module in _both().items():
        wrapper = module.UlyssesSPAttentionHF(sdpa_attention_forward, bs, hc, hs, hc_kv, 1, group,
                                              seq_length_is_variable=True)
        wrapper.core_attn_implementation = "sdpa"  # what DeepSpeed's registration sets after construction
        shards = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        got, _ = wrapper(Attention(), *shards, None, position_ids=positions[:, mine])
        got = got.reshape(bs, sl_l, hc, hs)  # DeepSpeed returns [bs sl_l hc*hs], ours [bs sl_l hc hs]
        got.pow(2).sum().backward()
        out[name] = {"out": got.detach(), "grads": [x.grad for x in shards]}
    out["want"] = want[:, mine]
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_attention_matches_deepspeed_and_is_exact_where_deepspeed_is_not(packed):
    for res in run_distributed(_attention, 2, packed):
        ours, ds = res["ours"], res["deepspeed"]
        assert rel_err(ours["out"], res["want"]) <= 1e-6  # exact: per document, GQA, both ranks
        if packed:  # DeepSpeed's sdpa path attends across the documents of a packed sample
            assert rel_err(ds["out"], res["want"]) > 1e-3
        else:
            assert rel_err(ours["out"], ds["out"]) <= 1e-6
            for mine, theirs in zip(ours["grads"], ds["grads"]):
                assert rel_err(mine, theirs) <= 1e-6


def _train_step(rank, world_size, stage, implementation, loss_recipe):
    """DeepSpeed's TestUlyssesSPHF, once per implementation: model A runs the whole 6-token sample
    without SP (here in plain torch: a DeepSpeed engine built earlier in the same process leaves
    global state that changes how a later engine reduces gradients), model B trains on its shard
    through register_with_transformers, the adapter and a DeepSpeed engine. Returns both losses and
    model B's full q_proj gradient next to model A's."""
    import deepspeed
    from deepspeed.utils import groups, safe_get_full_grad
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = _both()[implementation]
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "sequence_parallel_size": world_size}
    cfg = tiny_config("llama", heads=4, kv_heads=2, head_dim=4)
    model_a = tiny_model(cfg)  # the reference: the same model on the whole sample, plain torch
    batch = next(iter(_sample_loader()))
    batch.pop("source")
    loss_a = model_a(**batch).loss
    loss_a.backward()
    grad_a = model_a.model.layers[0].self_attn.q_proj.weight.grad

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mpu = module.UlyssesSPAttentionHF.register_with_transformers(cfg_holder(cfg), "sdpa", world_size, 1)
    model_b = tiny_model(cfg)
    engine_b, *_ = deepspeed.initialize(config=config, model=model_b, model_parameters=model_b.parameters(), mpu=mpu)
    group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    adapter = module.UlyssesSPDataLoaderAdapter(_sample_loader(), sp_rank=sp_rank, sp_group=group,
                                                sp_world_size=world_size, device=engine_b.device)
    batch_b = next(iter(adapter))
    batch_b.pop("source")
    shift_labels = batch_b.pop("shift_labels")
    if loss_recipe == "tutorial":  # DeepSpeed's: per-rank mean, differentiable all-gather, token weights
        logits = engine_b(**batch_b).logits
        loss_b = engine_b.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                               vocab_size=cfg.vocab_size)
        losses = torch.distributed.nn.functional.all_gather(loss_b, group=group)
        tokens = torch.distributed.nn.functional.all_gather((shift_labels != -100).sum(), group=group)
        loss_b = sum(l * t for l, t in zip(losses, tokens)) / sum(tokens)
    else:  # ours: the global token mean, its backward scaled for this ZeRO stage's reduction
        ds_ulysses.enable_sp_loss(engine_b.module, group, ds_ulysses.engine.loss_grad_scale(config, world_size))
        loss_b = engine_b(**batch_b, shift_labels=shift_labels).loss
    engine_b.backward(loss_b)
    grad_b = safe_get_full_grad(engine_b.module.model.layers[0].self_attn.q_proj.weight)
    if implementation == "ours":
        ds_ulysses.uninstall()
    else:  # DeepSpeed's registration has no undo: put Transformers' sdpa back for the next case
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return {"loss_a": loss_a.item(), "loss_b": loss_b.item(), "grad_a": grad_a, "grad_b": grad_b}


class cfg_holder:
    """register_with_transformers reads ``.config`` only (DeepSpeed's PEFT test passes such an object)."""

    def __init__(self, config):
        self.config = config


def _deepspeed_scenario(rank, world_size, stage):
    return {(impl, recipe): _train_step(rank, world_size, stage, impl, recipe)
            for impl, recipe in (("deepspeed", "tutorial"), ("ours", "tutorial"), ("ours", "sp_loss"))}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_s_sp_training_scenario_gives_deepspeed_s_numbers_and_ours_is_exact(stage):
    for res in run_distributed(_deepspeed_scenario, 2, stage, timeout=600):
        ds, ours, exact = res["deepspeed", "tutorial"], res["ours", "tutorial"], res["ours", "sp_loss"]
        # the drop-in: the same user code gives DeepSpeed's numbers
        assert rel_err(torch.tensor(ours["loss_b"]), torch.tensor(ds["loss_b"])) <= 1e-6
        assert rel_err(ours["grad_b"], ds["grad_b"]) <= 1e-5
        # the loss equals the unsharded model's with either recipe
        assert rel_err(torch.tensor(ds["loss_b"]), torch.tensor(ds["loss_a"])) <= 1e-5
        assert rel_err(torch.tensor(exact["loss_b"]), torch.tensor(exact["loss_a"])) <= 1e-5
        # the gradient: ours is the unsharded model's on every stage; the tutorial recipe's sums over
        # SP peers on ZeRO-1/2 (2x at sp 2), which only ZeRO-3's averaging reduction cancels
        assert rel_err(exact["grad_b"], exact["grad_a"]) <= 1e-4
        factor = 1.0 if stage == 3 else 2.0
        assert rel_err(ds["grad_b"], factor * ds["grad_a"]) <= 1e-4


def _clipped_step(rank, world_size, stage, implementation):
    """DeepSpeed's tutorial setup (register_with_transformers' mpu, the adapter, its loss recipe) with
    gradient clipping and plain SGD: the step's update over the engine's own full gradient, against
    torch's clip coefficient min(1, clip / norm), and the norm the engine reports."""
    from deepspeed.utils import groups, safe_get_full_grad

    clip = 0.1
    engine, undo = _engine_on(implementation, world_size, stage, gradient_clipping=clip,
                              optimizer={"type": "SGD", "params": {"lr": 1.0}}, zero_allow_untested_optimizer=True)
    adapter = _both()[implementation].UlyssesSPDataLoaderAdapter(
        _sample_loader(), sp_rank=groups._get_sequence_parallel_rank(), sp_group=groups._get_sequence_parallel_group(),
        sp_world_size=world_size, device=engine.device)
    batch = next(iter(adapter))
    batch.pop("source")
    shift_labels = batch.pop("shift_labels")
    logits = engine(**batch).logits
    engine.backward(engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                                vocab_size=logits.shape[-1]))
    grad = torch.cat([safe_get_full_grad(p).flatten() for p in engine.module.parameters()])
    before = [full_fp32_param(p) for p in engine.module.parameters()]
    engine.step()
    update = torch.cat([(b - full_fp32_param(p)).flatten() for p, b in zip(engine.module.parameters(), before)])
    undo()
    reported = engine.get_global_grad_norm()  # None where DeepSpeed keeps no norm (fp32 at ZeRO-0)
    return {"grad_norm": grad.norm().item(), "reported": None if reported is None else float(reported),
            "clip_error": rel_err(update, min(1.0, clip / (grad.norm().item() + 1e-6)) * grad)}


def _clipped_steps(rank, world_size, stage):
    return {impl: _clipped_step(rank, world_size, stage, impl) for impl in ("deepspeed", "ours")}


@pytest.mark.parametrize("stage", [0, 1])
def test_gradient_clipping_clips_by_the_gradient_s_norm_as_deepspeed_s_does(stage):
    """At ZeRO-0 DeepSpeed sums the squared norm over the mpu's model-parallel group: ours (no model
    parallelism) must be this rank alone, not the world, or the clip is sqrt(world) x too strong."""
    for res in run_distributed(_clipped_steps, 2, stage, timeout=600):
        ds, ours = res["deepspeed"], res["ours"]
        assert ds["grad_norm"] > 2 * 0.1, res  # the clip is active
        assert rel_err(torch.tensor(ours["grad_norm"]), torch.tensor(ds["grad_norm"])) <= 1e-6, res
        assert ds["clip_error"] <= 1e-5 and ours["clip_error"] <= 1e-5, res
        assert (ours["reported"] is None) == (ds["reported"] is None), res
        if ds["reported"] is not None:
            assert rel_err(torch.tensor(ours["reported"]), torch.tensor(ds["reported"])) <= 1e-6, res


def _engine_on(implementation, world_size, stage, **config):
    """A tiny Llama on a DeepSpeed engine with the module's registration and mpu (Adam unless ``config``
    says otherwise, so a checkpoint carries optimizer state); returns the engine and what undoes the
    registration."""
    import deepspeed
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module, sdpa = _both()[implementation], ALL_ATTENTION_FUNCTIONS["sdpa"]
    cfg = tiny_config("llama", heads=4, kv_heads=2, head_dim=4)
    mpu = module.UlyssesSPAttentionHF.register_with_transformers(cfg_holder(cfg), "sdpa", world_size, 1)
    model = tiny_model(cfg)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "sequence_parallel_size": world_size, **config}
    engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)

    def undo():
        if implementation == "ours":
            ds_ulysses.uninstall()
        else:  # DeepSpeed's registration has no undo: put Transformers' sdpa back
            ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa

    return engine, undo


def _resume_across(rank, world_size, stage, saver, loader, path):
    """``saver`` trains a step, saves, trains a second; ``loader`` loads that checkpoint and trains the same
    second step. Returns both second steps' full parameters."""
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(8)[None] + 8 * rank}  # rank's shard

    def step(engine):
        engine.backward(engine(**batch).loss)
        engine.step()
        return [full_fp32_param(p) for p in engine.module.parameters()]

    engine, undo = _engine_on(saver, world_size, stage)
    step(engine)
    engine.save_checkpoint(path, tag="step1")
    continued = step(engine)
    undo()
    engine, undo = _engine_on(loader, world_size, stage)
    engine.load_checkpoint(path, tag="step1")
    resumed = step(engine)
    undo()
    return {"continued": continued, "resumed": resumed}


@pytest.mark.parametrize("saver,loader", [("deepspeed", "ours"), ("ours", "deepspeed")])
def test_a_checkpoint_of_either_module_resumes_under_the_other(saver, loader, tmp_path):
    """Changing the import mid-run: the engine resumes DeepSpeed's checkpoint (the mpu names its files)
    with its optimizer state, and the second step is the one the saving run took."""
    for res in run_distributed(_resume_across, 2, 3, saver, loader, str(tmp_path), timeout=600):
        for resumed, continued in zip(res["resumed"], res["continued"]):
            assert rel_err(resumed, continued) <= 1e-5


def _mpus(rank, world_size):
    out = {}
    for name, module in _both().items():
        with warnings.catch_warnings(record=True):  # max_length: DeepSpeed's deprecated name for seq_length
            warnings.simplefilter("always")
            mpu = module.UlyssesSPAttentionHF.register_with_transformers(
                cfg_holder(tiny_config("llama")), "sdpa", world_size, 1, None, False, False, 16)
        out[name] = {"sp": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
                            dist.get_process_group_ranks(mpu.get_sequence_parallel_group())),
                     "sp_dp": (mpu.get_sequence_data_parallel_world_size(), mpu.get_sequence_data_parallel_rank())}
    out["fixed_length"] = register_module._dispatches["sdpa"].global_attn.global_seq_length
    ds_ulysses.uninstall()
    return out


def test_the_mpu_answers_like_deepspeed_s_and_max_length_is_its_seq_length():
    for res in run_distributed(_mpus, 2):
        assert res["ours"] == res["deepspeed"], res
        assert res["fixed_length"] == 16
