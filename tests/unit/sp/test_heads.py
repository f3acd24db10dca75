"""plan_heads: which query and KV heads each SP rank computes."""

import pytest

from ds_ulysses.sp.heads import plan_heads


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

