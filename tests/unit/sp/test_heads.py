"""plan_heads: which query and KV heads each SP rank computes."""

import pytest

from ds_ulysses.sp.heads import plan_attention_groups, plan_heads


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


def test_auto_takes_the_most_groups_that_split_evenly_over_the_sp_ranks():
    assert plan_attention_groups(32, 8, 1) == 8
    assert plan_attention_groups(32, 8, 8) == 4      # 8 query heads a group, one per rank
    assert plan_attention_groups(8, 2, 2) == 2
    assert plan_attention_groups(14, 2, 4) == 2      # uneven over 4 ranks whole or halved: the most groups
    assert plan_attention_groups(4, 4, 1, 2) == 2
    with pytest.raises(ValueError, match=r"tiled_attention shards=3 cannot split 8 query / 2 KV heads at sp 2: .*"
                                         r"expected one of \[1, 2\]; fix"):
        plan_attention_groups(8, 2, 2, 3)
