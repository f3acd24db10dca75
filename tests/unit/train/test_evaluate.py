"""Loss by position: SP 2 on 2 gloo ranks (sharded, ragged, padded samples) vs the plain model's logits.

The reference is independent of ds_ulysses: one process, full logits from ``model(input_ids)``,
cross-entropy against the next token, summed per position bucket with a Python loop. fp32 on CPU;
the SP path differs only by summation order (attention over all-to-all'd heads, tiled lm_head),
so 1e-5 relative is ample.
"""

import pytest
import torch
import torch.nn.functional as F

from ds_ulysses.train.evaluate import PositionLoss, bucket_edges, evaluate_positions

from tests.support.distributed import run_distributed
from tests.support.models import VOCAB, rel_err, tiny_config, tiny_model

BUCKET = 8
LENGTHS = (40, 33, 24, 37)  # rank 0 draws samples 0 and 2, rank 1 samples 1 and 3: ragged, 33 and 37 padded


def _samples():
    g = torch.Generator().manual_seed(7)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _model():
    return tiny_model(tiny_config("llama", heads=4, kv_heads=2), seed=3)


def _reference(buckets) -> tuple[torch.Tensor, torch.Tensor]:
    model = _model().eval()
    edges = bucket_edges(buckets, max(LENGTHS)).tolist()
    sums, counts = torch.zeros(len(edges) - 1, dtype=torch.float64), torch.zeros(len(edges) - 1, dtype=torch.int64)
    with torch.no_grad():
        for s in _samples():
            logits = model(input_ids=s["input_ids"][None]).logits[0]  # [sl V]
            losses = F.cross_entropy(logits[:-1].double(), s["labels"][1:], reduction="none")
            for pos, loss in enumerate(losses.tolist()):
                b = max(i for i, e in enumerate(edges) if e <= pos)
                sums[b] += loss
                counts[b] += 1
    return sums, counts


def _sp_rank(rank, world_size, ring=1):
    from ds_ulysses import register_with_transformers
    from ds_ulysses.distributed.mesh import Mesh

    mesh = Mesh(1, world_size, ring_size=ring)
    model = _model()
    register_with_transformers(model, "sdpa", world_size, 1, mesh=mesh, scope="model")
    out = {}
    for buckets in ("log2", BUCKET):
        result = evaluate_positions(model, _samples(), mesh, buckets)
        out[buckets] = (result.sums.tolist(), result.counts.tolist())  # lists: queue-safe after the worker exits
    return out


@pytest.mark.parametrize("ring", [1, 2])  # 2: the sequence as a ring of two (head-tail shards)
def test_sp2_equals_unsharded_reference(ring):
    results = run_distributed(_sp_rank, 2, ring)
    for buckets in ("log2", BUCKET):
        ref_sums, ref_counts = _reference(buckets)
        for res in results:
            sums, counts = res[buckets]
            assert counts == ref_counts.tolist()
            assert rel_err(torch.tensor(sums) / torch.tensor(counts), ref_sums / ref_counts) <= 1e-5


def test_single_process_equals_reference_and_writes_csv_png(tmp_path):
    ref_sums, ref_counts = _reference(BUCKET)
    result = evaluate_positions(_model(), _samples(), None, BUCKET)
    assert torch.equal(result.counts, ref_counts)
    assert rel_err(result.mean, ref_sums / ref_counts) <= 1e-5
    rows = result.write_csv(tmp_path / "eval.csv").read_text().splitlines()
    assert rows[0] == "position_start,position_end,tokens,mean_loss"
    assert rows[1].startswith("0,7,32,") and len(rows) == 1 + len(ref_counts)
    png = result.plot(tmp_path / "eval.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_buckets_and_sample_count_errors():
    result = PositionLoss(bucket_edges(4, 12), torch.tensor([2.0, 0.0, 3.0], dtype=torch.float64),
                          torch.tensor([2, 0, 1]))
    assert result.rows() == [(0, 3, 2, 1.0), (8, 11, 1, 3.0)]
    assert abs(result.overall - 5 / 3) < 1e-12
    assert bucket_edges("log2", 40).tolist() == [0, 1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="expected at least one sample, got none"):
        evaluate_positions(_model(), [], None, BUCKET)
    with pytest.raises(ValueError, match=r"buckets: expected \"log2\" or a positive number .* got 0"):
        bucket_edges(0, 10)
