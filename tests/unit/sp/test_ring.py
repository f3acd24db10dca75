"""RingCore's refusals that need no ring: the core it is given, and what a layer's call asks of it."""

import re

import pytest
import torch

from ds_ulysses.sp.ring import RingCore, RingFacts, RingProblem, _check_call


class _Layer(torch.nn.Module):
    layer_idx, is_causal = 3, True


@pytest.mark.parametrize("core", ["flash_attention_2", "flex_attention", "kernels-community/flash-attn"])
def test_a_core_other_than_sdpa_is_refused_naming_ring_size(core):
    with pytest.raises(ValueError, match=rf"ring_size=2 needs attn_implementation 'sdpa', got '{core}'.*fix: set "
                                         r"attn_implementation to \"sdpa\", or ring_size to 1"):
        RingCore(None, 2, 0, core)


@pytest.mark.parametrize("kwargs,asked", [
    ({"dropout": 0.1}, "attention dropout 0.1"),
    ({"softcap": 50.0}, "logit soft-capping 50.0"),
    ({"s_aux": torch.zeros(4)}, "attention sinks (s_aux)"),
    ({"is_causal": False}, "bidirectional attention"),
    ({"sliding_window": 8}, "a sliding window of 8 tokens over a 16-token sequence"),
])
def test_what_the_ring_kernel_lacks_is_refused_by_name(kwargs, asked):
    expected = re.escape(f"layer 3 (_Layer) asks for {asked}; the ring attention (ring_size > 1) serves causal sdpa")
    with pytest.raises(ValueError, match=expected):
        _check_call(_Layer(), 16, (), kwargs)


def test_a_window_as_long_as_the_sequence_and_zero_dropout_are_served():
    _check_call(_Layer(), 16, (), {"sliding_window": 16, "dropout": 0.0, "scaling": 0.5, "softcap": None})


def test_ring_facts_round_trip_as_one_tensor():
    facts = RingFacts(int(RingProblem.LEFT_PADDING), 2, 12)
    assert RingFacts.from_tensor(facts.to_tensor("cpu")) == facts
