"""Multi-node: the deepspeed launcher with a hostfile runs examples/train.py at dp 2 x sp 2.

Two "nodes" of 2 ranks each are simulated on this machine the way nodes without passwordless ssh are
launched: the same ``deepspeed --hostfile H --no_ssh --node_rank N --master_addr A`` command on every
node, N = 0 and 1 (real nodes: docs/multi-node.md). SP groups are contiguous ranks, so each SP group
lives inside a node and the DP reduction crosses nodes. Step 1's printed loss (the mean over the two DP
groups) equals the two samples' losses computed in this process without SP or DeepSpeed, to the 4
decimals printed: a mesh built across the nodes any other way would train other samples together.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support import REPO
from tests.support.distributed import free_port

pytestmark = pytest.mark.slow

SEQ = 128


def _reference_step1() -> float:
    """What the job's step 1 trains: dp group g runs its first rank's first sample, held-out samples first."""
    from ds_ulysses.train.corpus import PackedSamples, load_tokenizer, stdlib_texts
    from ds_ulysses.train.recipe import build_model

    tokenizer = load_tokenizer(None)
    model = build_model(None, tokenizer)
    world, held_out = 4, 4  # --eval-samples defaults to the world size
    data = PackedSamples(stdlib_texts, tokenizer, SEQ, held_out + world)
    losses = []
    with torch.no_grad():
        for rank in (0, 2):  # the first rank of each SP group: DistributedSampler hands rank r sample r
            sample = data[held_out + rank]
            losses.append(model(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).loss.item())
    return sum(losses) / len(losses)


def test_two_nodes_of_two_ranks_train_dp2_sp2(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    port = str(free_port())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
               str(REPO / "examples" / "train.py"), "--deepspeed_config", str(REPO / "examples" / "ds_config_cpu.json"),
               "--seq-len", str(SEQ), "--steps", "2", "--save-every", "0", "--buckets", "64",
               "--out", str(tmp_path / "run")]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [proc.communicate(timeout=600)[0] for proc in nodes]
    for proc, out in zip(nodes, outputs):
        assert proc.returncode == 0, out[-4000:]
    step1 = re.search(r"step 1/2 \[[#-]+\] loss (\d+\.\d+) .* RSS GB r0 [\d.]+ r1 [\d.]+ r2 [\d.]+ r3 [\d.]+$",
                      outputs[0], re.MULTILINE)  # rank 0 prints, on node 0; four ranks report
    assert step1 is not None, outputs[0][-4000:]
    assert abs(float(step1.group(1)) - _reference_step1()) <= 6e-5
    assert "eval: mean loss" in outputs[0]
