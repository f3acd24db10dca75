"""The data loader adapter: golden shards, padding, ragged ranks, lean exchange, errors."""

import pytest
import torch
import torch.distributed as dist

from ds_ulysses.data import AdapterCounter, UlyssesSPDataLoaderAdapter, prepare_sample

from .distributed import run_distributed


def _adapter_outputs(rank, world_size, batches, kwargs):
    group = dist.new_group(list(range(world_size)))
    adapter = UlyssesSPDataLoaderAdapter(batches[rank], rank, group, world_size, "cpu", **kwargs)
    AdapterCounter.bytes_received = 0
    first = list(adapter)
    received = AdapterCounter.bytes_received
    second = list(adapter)  # a new epoch restarts cleanly
    return {"len": len(adapter), "epoch1": first, "epoch2": second, "received": received}


def test_golden_sp2():
    sample = {"input_ids": torch.tensor([[1, 10, 10, 10, 2, 2]]), "position_ids": torch.arange(6)[None],
              "labels": torch.tensor([[1, 10, 10, 10, 2, 2]])}
    r0, r1 = run_distributed(_adapter_outputs, 2, [[sample], [sample]], {})
    assert r0["len"] == r1["len"] == 2
    mine0, mine1 = r0["epoch1"][0], r1["epoch1"][0]
    assert mine0["input_ids"].tolist() == [[1, 10, 10]]
    assert mine0["position_ids"].tolist() == [[0, 1, 2]]
    assert mine0["shift_labels"].tolist() == [[10, 10, 10]]
    assert mine1["input_ids"].tolist() == [[10, 2, 2]]
    assert mine1["position_ids"].tolist() == [[3, 4, 5]]
    assert mine1["shift_labels"].tolist() == [[2, 2, -100]]
    assert "labels" not in mine0 and mine0["input_ids"].device.type == "cpu"
    assert [len(r0["epoch1"]), len(r0["epoch2"])] == [2, 2]


def _sample(length, seed, extra=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (1, length), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    out.update(extra or {})
    return out


def test_ragged_ranks_padding_and_lean_exchange():
    """Ranks draw 48 and 81 tokens at sp 2: every shard is right, and each rank receives one shard
    of each peer's tensors (sl tokens per tensor in all), not whole batches."""
    batches = [[_sample(48, 0, {"doc": "a"})], [_sample(81, 1, {"doc": ["b", 2]})]]
    results = run_distributed(_adapter_outputs, 2, batches, {"pad_token_id": 7})
    for rank, res in enumerate(results):
        for k, micro in enumerate(res["epoch1"]):
            full = prepare_sample(batches[k][0], 2, pad_token_id=7)
            sl_l = full["input_ids"].shape[1] // 2
            for key in ("input_ids", "position_ids", "shift_labels"):
                assert torch.equal(micro[key], full[key][:, rank * sl_l:(rank + 1) * sl_l])
            assert micro["doc"] == batches[k][0]["doc"]
        # tensors: input_ids, position_ids, shift_labels, int64; peer's shard only (own shard stays local)
        peer = 1 - rank
        peer_len = prepare_sample(batches[peer][0], 2)["input_ids"].shape[1]
        assert res["received"] == 3 * 8 * peer_len // 2


def test_prepare_sample_pads_to_multiple_and_keeps_loss_mask():
    out = prepare_sample({"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[5, 6, 7, 8, 9]])},
                         4, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert out["shift_labels"].tolist() == [[6, 7, 8, 9, -100, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_prepare_sample_generates_position_ids():
    out = prepare_sample({"input_ids": torch.ones(2, 4, dtype=torch.long)}, 2)
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]] * 2


def test_padding_off_says_how_to_pad():
    with pytest.raises(ValueError, match="not divisible by sequence_parallel_size=4.*pad_to_multiple"):
        prepare_sample({"input_ids": torch.ones(1, 6, dtype=torch.long)}, 4, pad_to_multiple=False)


def test_tensors_disagreeing_in_length_raise():
    with pytest.raises(ValueError, match="share the sequence length.*'labels' has shape \\[1, 5\\]"):
        prepare_sample({"input_ids": torch.ones(1, 6, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long)}, 2)


def test_missing_input_ids_raise():
    with pytest.raises(ValueError, match="needs a tensor 'input_ids'"):
        prepare_sample({"tokens": torch.ones(1, 6)}, 2)


def _mismatch(rank, world_size):
    group = dist.new_group([0, 1])
    dtype = torch.long if rank == 0 else torch.int32
    batch = {"input_ids": torch.ones(1, 4, dtype=dtype)}
    try:
        next(iter(UlyssesSPDataLoaderAdapter([batch], rank, group, 2, "cpu")))
    except ValueError as err:
        return str(err)
    return None


def test_dtype_mismatch_raises_on_every_rank():
    messages = run_distributed(_mismatch, 2, timeout=60)
    assert all(m is not None and "SP ranks disagree on 'input_ids'" in m for m in messages)


def test_single_rank_is_local():
    adapter = UlyssesSPDataLoaderAdapter([_sample(5, 0)], 0, None, 1, "cpu")
    (micro,) = list(adapter)
    assert micro["shift_labels"].shape == (1, 5) and len(adapter) == 1
