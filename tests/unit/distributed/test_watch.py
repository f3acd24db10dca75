"""GroupWatch: collective failures re-raised naming the SP group and step; other errors untouched."""

import pytest
import torch
import torch.distributed as dist

from ds_ulysses.distributed.watch import GroupWatch, SPCommError
from tests.support.distributed import free_port


def test_watch_leaves_ordinary_errors_alone_and_names_group_and_step_for_collectives():
    watch = GroupWatch([4, 5], timeout_seconds=10)
    watch.step = 7
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        with watch.collective("x"):
            raise RuntimeError("shape mismatch")
    assert not isinstance(info.value, SPCommError)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(SPCommError, match=r"SP group ranks \[4, 5\]: the test's gather failed at step 7 "
                                              r"\(.*\); .*comm_timeout_seconds=10"):
            with watch.collective("the test's gather"):
                dist.all_gather([torch.zeros(1)], torch.zeros(2))  # a collective that fails
        with pytest.raises(SPCommError, match=r"SP group ranks \[4, 5\]: the per-layer all-to-all failed"):
            try:
                dist.all_gather([torch.zeros(1)], torch.zeros(2))
            except RuntimeError as err:
                watch.reraise("the per-layer all-to-all", err)
    finally:
        dist.destroy_process_group()
