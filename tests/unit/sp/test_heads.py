"""plan_heads: which query and KV heads each SP rank computes."""

import pytest

from ds_ulysses.sp.heads import plan_heads, resolve_ring_size


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        plan_heads(4, 2, 8)


def test_unservable_gqa_layout_is_refused():
    with pytest.raises(ValueError, match="attention layout not servable: 6 query heads"):
        plan_heads(6, 4, 2)


@pytest.mark.parametrize("heads,kv,ws", [(14, 2, 4), (8, 2, 4), (6, 1, 4), (5, 5, 2), (32, 8, 4), (12, 3, 8)])
def test_head_plan_covers_every_query_head_once_with_its_kv_head(heads, kv, ws):
    plan = plan_heads(heads, kv, ws)
    assert [h for hs in plan.q_heads for h in hs] == list(range(heads))
    assert [len(hs) for hs in plan.q_heads] == [heads // ws + (r < heads % ws) for r in range(ws)]
    group = heads // kv
    for r in range(ws):
        rep = plan.kv_groups(r)
        for i, h in enumerate(plan.q_heads[r]):
            assert plan.kv_heads[r][i // rep] == h // group  # the core's GQA mapping reads the right KV head


@pytest.mark.parametrize("ring,sp,heads,node,expected", [
    (1, 4, [8], None, 1), (2, 4, [2], None, 2), (4, 4, [2], None, 4),
    ("auto", 4, [8], None, 1), ("auto", 8, [2, 4], None, 4), ("auto", 6, [4], None, 2),
    ("auto", 16, [32], 8, 2), ("auto", 16, [4], 8, 4), ("auto", 8, [1], None, 8)])
def test_ring_size_resolves_to_a_divisor_that_fits_the_heads(ring, sp, heads, node, expected):
    assert resolve_ring_size(ring, sp, heads, node) == expected


def test_ring_size_too_small_names_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"Ulysses degree of sequence_parallel_size / ring_size = 4, more than the "
                                         r"model's 2 query heads.*fix: set ring_size to 2 \(the smallest"):
        resolve_ring_size(1, 4, [2, 8], None)
    with pytest.raises(ValueError, match=r"fix: set ring_size to 3 \(the smallest"):
        resolve_ring_size(1, 6, [2], None)


@pytest.mark.parametrize("ring", [3, 0, True, "2"])
def test_ring_size_not_a_divisor_is_refused(ring):
    with pytest.raises(ValueError, match=r"ring_size: expected \"auto\" or a divisor of sequence_parallel_size=4"):
        resolve_ring_size(ring, 4, [8], None)
