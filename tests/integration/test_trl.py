"""TRL's SFTTrainer with Ulysses SP at sp 2 on 2 gloo ranks against the same SFTTrainer on one process
without SP (tests/support/trainer_cases.py).

SFTTrainer trains through its fused LM head (``fused_lm_head=True``: per-token log-probs, no logits); the
SP loss is that head's global token mean. Prompt-completion samples (loss on completions only), 2
micro-batches per step: the logged losses (rel 1e-5), the update of every trainable parameter, the sum of
its gradients (rel 1e-4), and the eval loss after training (rel 1e-5). The second case packs (TRL's
padding-free collator, whose varlen offsets ``cu_seq_lens_*`` the adapter turns into position_ids;
DeepSpeed's adapter raises on them) and trains PEFT LoRA adapters with every ALST switch on. The first
trains a Mixtral whose router load-balancing loss TRL's head adds, divided over the accumulation steps:
under SP it is the whole sequence's, weighted the same way, from MoE blocks in 2 tiles each. TRL's
DPOTrainer, whose loss is per sample and computed without the Trainer's ``compute_loss``, is refused at
its first training forward (it trained silently wrong before: 0.25 away in update from itself without SP).
"""

import pytest

from tests.support import trainer_cases as tc
from tests.support.distributed import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage,packing,moe", [(1, False, True), (3, True, False)],
                         ids=["padded-moe-router-loss-zero1", "packed-lora-zero3-alst"])
def test_sft_trainer_trains_as_the_same_sft_trainer_without_sp(stage, packing, moe, tmp_path):
    (plain,) = run_distributed(tc.sft_trainer_run, 1, stage, str(tmp_path / "plain"), False, packing, moe,
                               timeout=600)
    assert any("lora_B" in n for n in plain["start"]) == packing
    want = {"losses": plain["logged"], "start": plain["start"],
            "update": {n: plain["params"][n] - p for n, p in plain["start"].items()}}
    for res in run_distributed(tc.sft_trainer_run, 2, stage, str(tmp_path / "sp"), True, packing, moe, timeout=600):
        assert len(res["logged"]) == 2 and sorted(res["start"]) == sorted(plain["start"])
        assert all(res["start"][n].equal(p) for n, p in plain["start"].items())
        errors = tc.compare({**res, "losses": res["logged"]}, want)
        assert errors["loss"] <= 1e-5 and errors["update"] <= 1e-4, errors
        assert abs(res["eval_loss"] - plain["eval_loss"]) <= 1e-5 * plain["eval_loss"]


def test_a_trl_trainer_with_a_per_sample_loss_is_refused_naming_its_compute_loss(tmp_path):
    for error in run_distributed(tc.dpo_trainer_refused, 2, str(tmp_path), timeout=600):
        assert error.startswith("Ulysses SP (sp_size=2) cannot serve DPOTrainer.compute_loss: it computes its "
                                "training loss without Trainer.compute_loss"), error
        assert "return super().compute_loss(...)" in error
