"""The helpers the tiled Functions share: tile counts and bounds, declared parameters, tile slices.
(Their ZeRO-3 side runs in tests/integration/test_tiled_zero.py.)"""

import math

import pytest
import torch
from torch import nn

from ds_ulysses.memory import agree_on_shards, auto_loss_shards, auto_mlp_shards
from ds_ulysses.memory.tiles import seq_tile, tile_bounds, trainable_params, zero3_whole

from .helpers import SPLITS, tile_sizes


def test_auto_shards_and_agreement_without_distributed():
    assert auto_mlp_shards(4096, 4096) == 1
    assert auto_mlp_shards(4097, 4096) == 2
    assert auto_mlp_shards(1, 64) == 1
    # 2**25 fp32 logits fit in the 128 MiB default budget
    assert auto_loss_shards(2**10, 2**15) == 1
    assert auto_loss_shards(2**10 + 1, 2**15) == 2
    assert auto_loss_shards(8192, 32000) == 8  # 8K tokens per rank, 32K vocab: 1 GB of logits
    assert auto_loss_shards(1000, 1000, budget_bytes=1000 * 1000, dtype=torch.bfloat16) == 2
    assert auto_loss_shards(1000, 1000, budget_bytes=1000 * 1000, dtype=torch.float32) == 4
    assert agree_on_shards(3) == 3
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        auto_mlp_shards(10, 0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        agree_on_shards(2.5)


@pytest.mark.parametrize("length,shards", SPLITS + [(0, 3), (10, 4)])
def test_tile_bounds_have_tensor_split_sizes(length, shards):
    bounds = tile_bounds(length, shards)
    assert [stop - start for start, stop in bounds] == tile_sizes(length, shards)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_declared_parameters():
    lm_head, embed = nn.Linear(4, 6, bias=False), nn.Embedding(6, 4)
    lm_head.weight = embed.weight
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    loose = nn.Parameter(torch.ones(3))
    assert trainable_params(None, [lm_head, embed, loose, "not a module"]) == [embed.weight, loose]  # tied once
    assert trainable_params([frozen, loose, loose], []) == [loose]
    with pytest.raises(ValueError, match=r"compute_params must be a list of the parameters fn uses, or None, got "
                                         r"'weight'; pass e.g. \[module.weight\]"):
        trainable_params("weight", [])


def test_zero3_whole_leaves_other_tensors_alone():
    p = nn.Parameter(torch.ones(2))
    with zero3_whole([p]):
        assert torch.equal(p, torch.ones(2))


@pytest.mark.parametrize("shape, dim", [((1, 12, 4), 1), ((2, 12, 4), 1), ((1, 12, 2, 3), 1), ((12, 4), 0)])
def test_seq_tile_has_a_fresh_tensors_strides(shape, dim):
    """A slice of a [1, sl, h] tensor is contiguous but keeps the whole sequence's batch stride, which
    makes matmul take its batched path; the tile must look like a tensor of its own."""
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    tile = seq_tile(x, 3, 8, dim)
    assert torch.equal(tile, x.narrow(dim, 3, 5))
    assert tile.stride() == torch.empty(tile.shape).stride()
