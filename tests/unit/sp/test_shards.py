"""The shard ledger and the forward check's shard verdicts: every rank's input is its shard of one sample."""

import pytest
import torch

from ds_ulysses.sp.forward_check import ForwardFacts, PositionCheck, ShardCheck, ShardStatus, check_forward
from ds_ulysses.sp.shards import ShardLedger, fingerprint


class Group:  # a stand-in for a process group: hashable and weakly referenceable, like ProcessGroup
    pass


def test_fingerprint_is_order_shape_and_dtype_aware_but_not_device_or_storage():
    ids = torch.arange(12).view(2, 6)
    assert fingerprint(ids) == fingerprint(ids.clone()) == fingerprint(ids.to(torch.int32))
    assert fingerprint(ids) == fingerprint(ids.t().contiguous().t())  # another memory layout, same values
    assert fingerprint(ids) != fingerprint(ids.flip(1))
    assert fingerprint(ids) != fingerprint(ids.view(3, 4))
    assert fingerprint(torch.full((1, 4), 2**40)) != fingerprint(torch.full((1, 4), 2**40 + 1))


def test_unrequired_groups_are_not_checked():
    ledger, group = ShardLedger(), Group()
    ledger.record(group, [torch.ones(1, 4, dtype=torch.long)])
    assert ledger.verdict(group, torch.zeros(1, 4, dtype=torch.long)) == ShardCheck()
    assert ledger.verdict(None, torch.zeros(1, 4)) == ShardCheck()


def test_verdicts_of_a_required_group():
    ledger, group = ShardLedger(), Group()
    ledger.require(group)
    a, b = torch.arange(4)[None], torch.arange(4, 8)[None]
    assert ledger.verdict(group, a).status == ShardStatus.NO_ADAPTER
    ledger.record(group, [a, b])
    assert ledger.verdict(group, a) == ShardCheck(ShardStatus.SHARD, serial=0)
    assert ledger.verdict(group, b) == ShardCheck(ShardStatus.SHARD, serial=1)
    assert ledger.verdict(group, torch.arange(8)[None]) == ShardCheck(ShardStatus.NOT_A_SHARD, rows=1, cols=8)
    assert ledger.yielded(group, b) and not ledger.yielded(group, torch.arange(8)[None])
    assert ledger.verdict(group, None) == ShardCheck()  # inputs_embeds: nothing to compare
    ledger.release(group)
    assert ledger.verdict(group, torch.arange(8)[None]) == ShardCheck()


def test_a_shard_seen_twice_is_recognised_but_not_compared_by_position():
    # an all-padding shard recurs with different samples: its serial would differ between ranks
    ledger, group = ShardLedger(), Group()
    ledger.require(group)
    pad = torch.zeros(1, 4, dtype=torch.long)
    ledger.record(group, [torch.arange(4)[None], pad])
    ledger.record(group, [torch.arange(4, 8)[None], pad])
    assert ledger.verdict(group, pad) == ShardCheck(ShardStatus.SHARD, serial=-1)
    assert ledger.verdict(group, torch.arange(4, 8)[None]).serial == 2


def _facts(shard: ShardCheck, positions: PositionCheck = PositionCheck()) -> ForwardFacts:
    return ForwardFacts(8, 1, 0, 4, 2, 8, 8, positions, shard)


def test_forward_facts_carry_the_shard_verdict_through_the_gather():
    facts = _facts(ShardCheck(ShardStatus.NOT_A_SHARD, rows=1, cols=16), PositionCheck(1))
    assert ForwardFacts.from_tensor(facts.to_tensor("cpu")) == facts


@pytest.mark.parametrize("shards,message", [
    ([ShardCheck(ShardStatus.SHARD, 3), ShardCheck(ShardStatus.NO_ADAPTER)],
     "SP rank 1: Ulysses SP is configured for this model, but its input did not come from "
     "UlyssesSPDataLoaderAdapter: no adapter has yielded shards for this SP group"),
    ([ShardCheck(ShardStatus.NOT_A_SHARD, rows=1, cols=16)] * 2,
     "SP rank 0 (ranks [1] failed too): Ulysses SP is configured for this model, but its input_ids [1, 16] are "
     "not a shard UlyssesSPDataLoaderAdapter yielded"),
    ([ShardCheck(ShardStatus.SHARD, 4), ShardCheck(ShardStatus.SHARD, 5)],
     "SP ranks run shards of different micro-batches: per SP rank the adapter's micro-batch [4, 5]"),
])
def test_every_rank_raises_the_same_error_for_a_bad_shard(shards, message):
    # the shard verdict comes first: a missing adapter also leaves position_ids out, which is its symptom
    with pytest.raises(ValueError, match="fix: feed the model|fix: iterate the adapter") as err:
        check_forward([_facts(s, PositionCheck(1)) for s in shards], None)
    assert str(err.value).startswith(message)


def test_shards_of_one_micro_batch_pass():
    check_forward([_facts(ShardCheck(ShardStatus.SHARD, 7)), _facts(ShardCheck(ShardStatus.SHARD, 7))], None)
    check_forward([_facts(ShardCheck(ShardStatus.SHARD, -1)), _facts(ShardCheck(ShardStatus.SHARD, 7))], None)
    check_forward([_facts(ShardCheck()), _facts(ShardCheck())], None)  # not checked: the drop-in API
