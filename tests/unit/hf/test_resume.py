"""The Trainer's data check on a resume at another mesh (ds_ulysses.hf.resume), on DeepSpeed checkpoint files
written here (the Trainer's real resume: tests/integration/test_trainer_resume_mesh.py)."""

from types import SimpleNamespace

import pytest

from ds_ulysses.hf.resume import check_resume_data, check_trainer_resume
from ds_ulysses.reshard import CheckpointError, Layout
from tests.support.resume_cases import deepspeed_checkpoint


def _checkpoint(tmp_path, world, sp, micro, gas):
    deepspeed_checkpoint(tmp_path, ranks=world, config={"train_micro_batch_size_per_gpu": micro,
                                                         "gradient_accumulation_steps": gas,
                                                         "sequence_parallel_size": sp})
    return tmp_path


def test_the_same_global_batch_on_a_prefix_continues(tmp_path):
    checkpoint = _checkpoint(tmp_path, 2, 2, 1, 2)  # dp 1 x sp 2, global batch 2
    check_resume_data(checkpoint, Layout(2, 2, 1, 2), 3)  # its own mesh, mid-refill or not
    check_resume_data(checkpoint, Layout(4, 4, 1, 2), 3)  # dp 1 x sp 4
    check_resume_data(checkpoint, Layout(2, 1, 1, 1), 3)  # dp 2 x sp 1, one micro-batch a step: whole refills
    check_resume_data(checkpoint, Layout(1, 1, 1, 2), 3)  # one rank
    check_resume_data(tmp_path / "not_deepspeed", Layout(4, 4, 1, 2), 3)  # the Trainer's own load refuses it


def test_a_changed_global_batch_is_refused_naming_the_accumulation_that_keeps_it(tmp_path):
    checkpoint = _checkpoint(tmp_path, 2, 2, 1, 2)
    with pytest.raises(CheckpointError) as err:
        check_resume_data(checkpoint, Layout(4, 2, 1, 2), 2)  # dp 2: global batch 4
    message = str(err.value)
    assert message.startswith(f"global batch: the checkpoint {checkpoint} trained 2 samples per step (dp 1 x sp 2 on "
                              "2 ranks, micro batch 1, gradient_accumulation_steps 2), this job 4 (dp 2 x sp 2 on 4 "
                              "ranks, micro batch 1, gradient_accumulation_steps 2)")
    assert "fix: set gradient_accumulation_steps to 1 for this mesh, or set ignore_data_skip=True" in message


def test_a_position_part_way_into_a_refill_is_refused_on_either_side(tmp_path):
    wide = _checkpoint(tmp_path / "wide", 4, 2, 1, 1)  # dp 2 x sp 2: a step is half a refill
    with pytest.raises(CheckpointError, match=r"data position: the checkpoint \(dp 2 x sp 2 on 4 ranks.*\) stops 1 "
                                              r"steps into the epoch, part way into a refill of 4 samples.*fix: resume "
                                              r"on the checkpoint's mesh, or from a checkpoint whose step within the "
                                              r"epoch is a multiple of 2"):
        check_resume_data(wide, Layout(2, 1, 1, 1), 1)
    check_resume_data(wide, Layout(2, 1, 1, 1), 2)  # a refill boundary
    narrow = _checkpoint(tmp_path / "narrow", 1, 1, 2, 1)  # one rank, micro batch 2
    with pytest.raises(CheckpointError, match=r"data position: this job \(dp 1 x sp 2 on 2 ranks, micro batch 2"):
        check_resume_data(narrow, Layout(2, 2, 2, 1), 1)  # sp 2 with micro 2: samples 0-1 and 2-3 in turn


def test_the_trainer_s_resume_is_checked_only_when_it_skips_data(tmp_path):
    checkpoint = _checkpoint(tmp_path, 2, 2, 1, 2)

    def trainer(global_step=4, ignore_data_skip=False, gas=1):
        args = SimpleNamespace(ignore_data_skip=ignore_data_skip, per_device_train_batch_size=1,
                               gradient_accumulation_steps=gas)
        return SimpleNamespace(args=args, state=SimpleNamespace(global_step=global_step),
                               accelerator=SimpleNamespace(num_processes=4,
                                                           parallelism_config=SimpleNamespace(sp_size=4)))

    with pytest.raises(CheckpointError, match="global batch: .* this job 1 "):
        check_trainer_resume(trainer(), checkpoint, 4)
    check_trainer_resume(trainer(gas=2), checkpoint, 8)
    check_trainer_resume(trainer(ignore_data_skip=True), checkpoint, 0)
    check_trainer_resume(trainer(global_step=0), checkpoint, 0)
    check_trainer_resume(trainer(), None, 0)
