"""Accelerate's ALST test script (``accelerate/test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py``,
launched by Accelerate's ``tests/deepspeed/test_alst_ulysses_sp.py``), step by step in our code with the one
line README asks for, ``ds_ulysses.install()``: ``parallelism_config`` sp 2 (DeepSpeed's switch), the model from
``from_pretrained`` (left in eval mode: the script never calls ``model.train()``), 4 samples of 32 tokens,
Adam, and the loss DeepSpeed's tutorial writes (per-shard losses weighted by valid tokens through a
differentiable all-gather). Run by ``accelerate launch`` from the directory :mod:`tests.support.local_hub`
wrote; writes the step losses to the JSON file named by its one argument.

:func:`reference` is the same training in one process without SP, in plain torch.
"""

from __future__ import annotations

import json
import sys

import torch

SAMPLES, SEQ_LEN, LR, SEED = 4, 32, 1e-5, 42


def data() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.arange(1, SEQ_LEN * SAMPLES + 1).view(-1, SEQ_LEN) + 100  # [samples sl]
    position_ids = torch.arange(SEQ_LEN * SAMPLES).view(-1, SEQ_LEN)
    return input_ids, position_ids


def main(out_path: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig, set_seed
    from deepspeed.utils import groups
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ds_ulysses
    from examples.cpu_gloo import report_gloo_world
    from tests.support.local_hub import MODEL_NAME

    report_gloo_world()
    ds_ulysses.install()
    set_seed(SEED)
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=256, sp_seq_length_is_variable=True,
                                              sp_attn_implementation="sdpa")
    accelerator = Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2,
                                                                   sp_handler=handler))
    AutoTokenizer.from_pretrained(MODEL_NAME)
    model = AutoModelForCausalLM.from_pretrained(MODEL_NAME)  # in eval mode

    def collate(batch):
        ids, pos = batch[0]
        return {"input_ids": ids[None], "position_ids": pos[None], "labels": ids[None]}

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=1, collate_fn=collate)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    group, sp = groups._get_sequence_parallel_group(), accelerator.parallelism_config.sp_size
    unwrapped = accelerator.unwrap_model(model)
    losses = []
    for batch in loader:
        optimizer.zero_grad()
        shift_labels = batch["shift_labels"]
        loss = unwrapped.loss_function(logits=model(**batch).logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=unwrapped.config.vocab_size)
        per_rank = torch.distributed.nn.functional.all_gather(loss, group=group)
        tokens = torch.distributed.nn.functional.all_gather((shift_labels != -100).sum(), group=group)
        loss = sum(per_rank[r] * tokens[r] for r in range(sp) if tokens[r] > 0) / max(sum(tokens), 1)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "training": unwrapped.training}, f)
    torch.distributed.barrier()  # every rank's collectives done before the groups go (ds_ulysses.train.job.main)
    accelerator.end_training()


def reference(model_dir: str) -> list[float]:
    """The same samples, in the order the SP run trains them (one per step), in one process without SP."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for ids, pos in zip(*data()):
        optimizer.zero_grad()
        loss = model(input_ids=ids[None], position_ids=pos[None], labels=ids[None]).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    from ds_ulysses.train.job import leave

    main(sys.argv[1])
    leave(0)  # gloo's workers outlive the groups in globals (the all_gather's defaults): no interpreter teardown
