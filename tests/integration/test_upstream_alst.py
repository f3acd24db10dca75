"""Transformers' and Accelerate's own ALST tests, re-expressed: their scripts' steps in our code
(:mod:`tests.support.accelerate_alst`, :mod:`tests.support.transformers_alst`), launched as they launch them
(``accelerate launch``, 2 processes, on CPU with gloo), with ``ds_ulysses.install()`` added and a tiny Llama and
tokenizer built locally under the hub name they load.

Accelerate's script trains a model it never puts in train mode (``from_pretrained`` returns it in eval mode,
where ``parallelism_config`` turns SP off with ``disable_in_eval``): its shards still run SP, so every loss
equals one process without SP (fp32: rel 1e-5, the correctness bar). Transformers' compares the Trainer's 10
losses with SP against the same launch without it at its own tolerance (atol 2e-2: the run without SP is data
parallel, two samples a step where SP trains one), with Llama's left-padding tokenizer, then evaluates on
127-token samples.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import accelerate_alst
from tests.support.local_hub import write_tiny_llama
from tests.support.models import rel_err
from tests.support.transformers_alst import DS_CONFIG

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(args: list[str], cwd, timeout: int = 420) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"accelerate launch exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_s_alst_script_trains_its_eval_mode_model_like_one_process(stage, tmp_path):
    model_dir = write_tiny_llama(str(tmp_path))
    out = tmp_path / "losses.json"
    _launch(["--num_processes=2", "--num_machines=1", "--machine_rank=0", "--mixed_precision=no", "--use_deepspeed",
             f"--zero_stage={stage}", os.path.join(ROOT, "tests", "support", "accelerate_alst.py"), str(out)],
            tmp_path)
    result = json.loads(out.read_text())
    assert not result["training"]  # the script's model stayed in eval mode
    expected = accelerate_alst.reference(model_dir)
    assert len(result["losses"]) == len(expected) == accelerate_alst.SAMPLES
    errors = [rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(result["losses"], expected)]
    assert max(errors) <= 1e-5, (result["losses"], expected)


def test_transformers_s_alst_test_passes_with_a_left_padding_tokenizer(tmp_path):
    # near-uniform predictions: the SP run trains one text a step, the run without SP two (data parallel), and the
    # upstream tolerance (atol 2e-2) holds only where the texts' losses differ by less (the hub's random model)
    write_tiny_llama(str(tmp_path), padding_side="left", initializer_range=0.002)
    ds_config = tmp_path / "ds_config_zero2.json"
    ds_config.write_text(json.dumps(DS_CONFIG))
    script = os.path.join(ROOT, "tests", "support", "transformers_alst.py")
    losses = {}
    for sp in (True, False):
        run = tmp_path / ("sp" if sp else "no_sp")
        run.mkdir()
        accelerate_config = run / "accelerate.yaml"
        lines = ["distributed_type: DEEPSPEED", "deepspeed_config:", f"  deepspeed_config_file: {ds_config}",
                 "machine_rank: 0", "num_machines: 1", "num_processes: 2"]
        if sp:
            lines += ["parallelism_config:", "  parallelism_config_sp_size: 2",
                      "  parallelism_config_sp_backend: deepspeed",
                      "  parallelism_config_sp_seq_length_is_variable: true",
                      "  parallelism_config_sp_attn_implementation: sdpa"]
        accelerate_config.write_text("\n".join(lines) + "\n")
        args = ["--config_file", str(accelerate_config), script, "--output_dir", str(run), "--report_to", "none",
                "--max_steps", "10", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                "--logging_steps", "1", "--remove_unused_columns", "False", "--seed", "42",
                "--loss_output_file", str(run / "losses.json")]
        if sp:
            args += ["--per_device_eval_batch_size", "1", "--eval_output_file", str(run / "eval.json")]
        _launch(args, tmp_path)
        losses[sp] = json.loads((run / "losses.json").read_text())
        if sp:
            eval_loss = json.loads((run / "eval.json").read_text())["eval_loss"]
    assert len(losses[True]) == len(losses[False]) == 10
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=2e-2, rtol=2e-5)
    assert torch.isfinite(torch.tensor(eval_loss))
