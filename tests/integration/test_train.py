"""examples/train.py end to end on 2 gloo ranks, SP 2, ZeRO-3 with CPU offload, tiled loss (the demo's config).

- resume: a run interrupted by a crash mid-save resumes from the previous complete checkpoint (taken
  mid-refill, so the resumed loader skips a micro-batch) and reproduces the uninterrupted run's loss
  at every later step (rel 1e-6: same data, same RNG, same optimizer and scheduler state; a wrong
  restore changes the loss by far more than rounding);
- export: the HF directory gathered from the ZeRO-3 checkpoint, loaded by plain
  ``from_pretrained``, gives the SP engine's logits (gathered over the SP group), rel 1e-5;
- the exported model's loss by position without SP equals the engine's with SP, rel 1e-5;
- the same checkpoint under another mesh with another global batch is refused with the setting named
  (resumes on other meshes with the same global batch: test_resume_mesh.py);
- the launchers: ``deepspeed`` and ``torchrun`` run the script, whose entry leaves no process group
  behind (a live gloo group aborted a finished rank at interpreter teardown).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import free_port, run_distributed
from tests.support.models import rel_err
from tests.support import REPO

pytestmark = pytest.mark.slow

ROOT = REPO
CONFIG = ROOT / "examples" / "ds_config_cpu.json"
SEQ = 64
STEPS = 8


def _example():
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(out, model_dir, *extra):
    return ["--deepspeed_config", str(CONFIG), "--model", str(model_dir), "--seq-len", str(SEQ), "--steps",
            str(STEPS), "--save-every", "3", "--out", str(out), "--buckets", "16", *extra]


def _engine_logits(engine, ids):
    """Logits of the SP engine on ``ids [1 sl]``: each rank its shard (the adapter's: an engine set up by
    the section takes no other input), gathered over the SP group."""
    import torch.distributed as dist

    from ds_ulysses import UlyssesSPDataLoaderAdapter

    mesh = engine.mpu
    batch = next(UlyssesSPDataLoaderAdapter([{"input_ids": ids}], mesh.sp_rank, mesh.sp_group, mesh.sp, "cpu"))
    with torch.no_grad():
        local = engine.module(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits  # [1 sl_l V]
    parts = [torch.empty_like(local) for _ in range(mesh.sp)]
    dist.all_gather(parts, local.contiguous(), group=mesh.sp_group)
    return torch.cat(parts, dim=1)  # [1 sl V]


def _uninterrupted(rank, world_size, out, model_dir):
    result = _example().train(_args(out, model_dir))
    ids = torch.arange(SEQ)[None] * 5 % 256
    # numpy: tensors sent through a multiprocessing queue live in the exiting worker's shared memory
    return {"losses": result["losses"], "logits": _engine_logits(result["engine"], ids).numpy(), "ids": ids.numpy(),
            "eval": (result["eval"].sums.numpy(), result["eval"].counts.numpy()),
            "checkpoint": str(result["checkpoint"])}


def _crash_then_resume(rank, world_size, out, model_dir, sp1_config):
    from ds_ulysses.train import checkpoint as ckpt

    example = _example()
    save_rng = ckpt._save_rng

    def crash_at_step_6(directory):
        if "step_00000006" in directory.name:
            raise RuntimeError("simulated crash mid-save")
        save_rng(directory)

    ckpt._save_rng = crash_at_step_6
    try:
        example.train(_args(out, model_dir))
    except RuntimeError as err:
        crashed = str(err)
    else:
        crashed = None
    finally:
        ckpt._save_rng = save_rng
    latest = str(ckpt.find_checkpoint(Path(out) / "checkpoints"))
    import torch.distributed as dist

    dist.barrier()
    resumed = example.train(_args(out, model_dir, "--resume"))
    try:  # the same checkpoint under sp=1 (dp=2, so twice the global batch): refused before DeepSpeed reads a file
        example.train(["--deepspeed_config", str(sp1_config), "--model", str(model_dir), "--seq-len", str(SEQ),
                       "--out", str(out), "--resume"])
    except ckpt.CheckpointError as err:
        refused = str(err)
    else:
        refused = None
    return {"crashed": crashed, "latest_after_crash": latest, "losses": resumed["losses"], "refused": refused}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("run")
    return out, run_distributed(_uninterrupted, 2, str(out), str(tiny_model_dir), timeout=600)


def test_resume_after_crash_mid_save_reproduces_the_losses_other_batch_refused(tmp_path, tiny_model_dir,
                                                                              uninterrupted):
    _, reference = uninterrupted
    config = json.loads(CONFIG.read_text())
    config["ulysses"]["sequence_parallel_size"] = 1
    (tmp_path / "sp1.json").write_text(json.dumps(config))
    results = run_distributed(_crash_then_resume, 2, str(tmp_path / "run"), str(tiny_model_dir),
                              str(tmp_path / "sp1.json"), timeout=600)
    expected = reference[0]["losses"]
    assert sorted(expected) == list(range(1, STEPS + 1))
    for res in results:
        assert res["crashed"] == "simulated crash mid-save"
        # step 3 is mid-refill (sp 2 takes 2 steps per refill): the resume re-reads it and skips one
        assert res["latest_after_crash"].endswith("step_00000003")
        assert sorted(res["losses"]) == [4, 5, 6, 7, 8]  # >= 4 steps after the resume
        for step, loss in res["losses"].items():
            assert abs(loss - expected[step]) <= 1e-6 * abs(expected[step]), (step, loss, expected[step])
        assert res["refused"].startswith("global batch: the checkpoint trained 1 samples per step (dp 1 x sp 2")
        assert "this job 2 (dp 2 x sp 1 on 2 ranks" in res["refused"]
        assert "fix: launch a mesh whose dp divides 1, or pass --allow-batch-change" in res["refused"]
    assert (tmp_path / "run" / "checkpoints" / "step_00000008" / "manifest.json").is_file()


def test_export_gives_the_engine_logits_without_sp_or_deepspeed(tmp_path, uninterrupted):
    from transformers import AutoModelForCausalLM

    from ds_ulysses.cli import main

    out, results = uninterrupted
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(results[0]["ids"])).logits
    for res in results:
        assert rel_err(torch.from_numpy(res["logits"]), logits) <= 1e-5


def test_exported_model_eval_without_sp_equals_engine_eval_with_sp(tmp_path, uninterrupted):
    from ds_ulysses.cli import main
    from ds_ulysses.train.corpus import ByteVocab, PackedSamples, stdlib_texts
    from ds_ulysses.train.evaluate import evaluate_positions
    from transformers import AutoModelForCausalLM

    out, results = uninterrupted
    assert main(["export", results[0]["checkpoint"], str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    plain = evaluate_positions(model, PackedSamples(stdlib_texts, ByteVocab(), SEQ, 2), None, 16)
    sums, counts = (torch.from_numpy(x) for x in results[0]["eval"])
    assert torch.equal(counts, plain.counts)
    assert rel_err(sums / counts, plain.mean) <= 1e-5
    assert main(["eval", str(tmp_path / "hf"), "--seq-len", str(SEQ), "--buckets", "16"]) == 0
    assert (tmp_path / "hf" / "eval" / "loss_by_position.png").is_file()
    assert (out / "eval" / "loss_by_position.csv").read_text().startswith("position_start,position_end")


def _script_entry(rank, world_size, out, model_dir):
    import torch.distributed as dist

    code = _example().main(_args(out, model_dir, "--steps", "2", "--save-every", "0"))
    return code, dist.is_initialized()


def test_the_script_entry_destroys_its_process_groups(tmp_path, tiny_model_dir):
    for code, initialized in run_distributed(_script_entry, 2, str(tmp_path / "out"), str(tiny_model_dir)):
        assert code == 0 and not initialized


def _remove_deepspeed_shm_buffers(port: str) -> None:
    """DeepSpeed's CPU all-reduce maps one 66 MiB shared-memory file per rank when its launcher says all
    ranks are local (LOCAL_SIZE) and never unlinks it: a test run would leave them in /dev/shm, where
    they add up to gigabytes of RAM over many runs."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        leftover.unlink(missing_ok=True)


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_launchers_run_the_script(tmp_path, launcher):
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    cmd += [str(ROOT / "examples" / "train.py"), "--deepspeed_config", str(CONFIG), "--seq-len", "256",
            "--steps", "2", "--save-every", "2", "--buckets", "64", "--out", str(tmp_path)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    finally:
        _remove_deepspeed_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2/2 [####################] loss " in proc.stdout
    assert "RSS GB r0 " in proc.stdout and " r1 " in proc.stdout
    assert (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").is_file()
    assert (tmp_path / "eval" / "loss_by_position.png").is_file()
