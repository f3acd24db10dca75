"""Loss by token position over held-out long sequences, with SP on or off: the long-context metric.

Dimension legend::  bs batch   sl_l local sequence length   sl_t one tile of it   h hidden   V vocabulary
                    nb number of position buckets

Does the model use its long context? If it does, the loss of predicting token ``p + 1`` falls as the
position ``p`` grows. The samples go through the same SP adapter as training, so each rank runs the
model on its shard (sequences no single rank would hold) and adds its tokens' losses into per-bucket
``(sum, count)`` vectors; one all_reduce over all ranks gives every rank the totals. Each token is
counted once: SP peers hold disjoint shards, DP groups disjoint samples. With one process the same
code runs unsharded, so the two agree to rounding.

Logits are never held whole: the decoder's hidden states go through the lm_head one tile at a time
(as in training's tiled loss), the same number of tiles on every rank, since under ZeRO-3 each tile
gathers the head's weight collectively.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from ..distributed.collectives import collective_device
from ..distributed.mesh import Mesh
from ..hf.head import logits_transform
from ..hf.model_facts import vocab_size
from ..hf.servable import decoder_of
from ..memory.tiles import zero3_whole
from ..memory.tiles import resolve_loss_shards
from ..sp.data import UlyssesSPDataLoaderAdapter

__all__ = ["PositionLoss", "bucket_edges", "evaluate_positions", "buckets_arg", "add_arguments", "run_command"]


def bucket_edges(buckets: int | str, max_positions: int) -> torch.Tensor:
    """Bucket boundaries ``[nb + 1]`` covering ``[0, max_positions)``.

    ``"log2"``: ``[0, 1), [1, 2), [2, 4), ...``: the first tokens, where the loss falls fastest as
    context accumulates, get their own buckets, and the long tail is averaged over many tokens so
    content noise does not swamp it. An int: buckets of that many positions.
    """
    if buckets == "log2":
        edges = [0, 1]
        while edges[-1] < max_positions:
            edges.append(2 * edges[-1])
        return torch.tensor(edges)
    if isinstance(buckets, int) and not isinstance(buckets, bool) and buckets > 0:
        return torch.arange(0, math.ceil(max_positions / buckets) + 1) * buckets
    raise ValueError(f"buckets: expected \"log2\" or a positive number of positions per bucket, got {buckets!r}; "
                     "fix: pass --buckets log2 or e.g. --buckets 1024")


@dataclass
class PositionLoss:
    """Per-bucket loss sums and token counts; bucket ``b`` holds positions ``[edges[b], edges[b+1])``."""

    edges: torch.Tensor  # [nb + 1] int64
    sums: torch.Tensor  # [nb] float64
    counts: torch.Tensor  # [nb] int64

    @property
    def mean(self) -> torch.Tensor:
        """Mean loss per bucket (NaN where a bucket has no token)."""
        return self.sums / self.counts.double()

    @property
    def overall(self) -> float:
        return (self.sums.sum() / self.counts.sum().clamp(min=1)).item()

    def rows(self) -> list[tuple[int, int, int, float]]:
        """``(first position, last position, tokens, mean loss)`` of each non-empty bucket."""
        edges = self.edges.tolist()
        return [(edges[b], edges[b + 1] - 1, int(n), float(m))
                for b, (n, m) in enumerate(zip(self.counts.tolist(), self.mean.tolist())) if n > 0]

    def write_csv(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["position_start", "position_end", "tokens", "mean_loss"])
            writer.writerows((a, b, n, f"{m:.6f}") for a, b, n, m in self.rows())
        return path

    def plot(self, path, title: str = "held-out loss by token position") -> Path:
        """A PNG of mean loss against position. Uses the Agg canvas directly: no global backend switch."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rows = self.rows()
        fig = Figure(figsize=(7, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        widths = (self.edges[1:] - self.edges[:-1]).tolist()
        log = len(set(widths)) > 1  # log2 buckets go on a log axis, each at its geometric middle
        # x is the context a prediction had: position p has seen p + 1 tokens
        xs = [math.sqrt((a + 1) * (b + 1)) if log else (a + b) / 2 + 1 for a, b, _, _ in rows]
        ax.plot(xs, [m for *_, m in rows], marker="o", markersize=3)
        if log:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("context: tokens seen before the predicted one (position + 1)")
        ax.set_ylabel("mean cross-entropy (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def _token_losses(model, batch: dict, transform) -> torch.Tensor:
    """Per-token cross-entropy ``[bs sl_l]`` of this rank's shard (0 where the label is -100), with the
    model's own logits ``transform`` (:func:`ds_ulysses.hf.head.logits_transform`)."""
    device = model.get_input_embeddings().weight.device
    hidden = decoder_of(model)(input_ids=batch["input_ids"].to(device),
                               position_ids=batch["position_ids"].to(device)).last_hidden_state  # [bs sl_l h]
    labels = batch["shift_labels"].to(device)  # [bs sl_l]
    bs, sl_l, h = hidden.shape
    flat, flat_labels = hidden.reshape(bs * sl_l, h), labels.reshape(bs * sl_l)  # [bs*sl_l h], [bs*sl_l]
    head = model.get_output_embeddings()
    tiles = resolve_loss_shards("auto", bs * sl_l, vocab_size(model, output=True))
    step = max(1, math.ceil(bs * sl_l / tiles))
    out = []
    for t in range(tiles):  # every rank runs `tiles` head calls, even on an empty slice
        x, y = flat[t * step:(t + 1) * step], flat_labels[t * step:(t + 1) * step]  # [sl_t h], [sl_t]
        logits = head(x)  # [sl_t V]
        logits = transform(logits) if transform is not None else logits
        out.append(F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="none"))
    return torch.cat(out).reshape(bs, sl_l).cpu()


@torch.no_grad()
def evaluate_positions(model, samples, mesh: Mesh | None = None, buckets: int | str = "log2",
                       max_positions: int | None = None, pad_token_id: int = 0) -> PositionLoss:
    """Loss by position of ``samples`` (dicts of ``input_ids`` and ``labels``, ``[sl]`` each).

    ``model`` is the HF model (``engine.module`` under DeepSpeed) with SP attention registered when
    ``mesh.sp > 1`` and active in eval mode (``disable_in_eval: false``, the default). Every rank
    calls this with the same samples. Each rank draws one sample per round, so a count that is not a
    multiple of the world size (a resumed run keeps its checkpoint's held-out count on a new mesh) is
    topped up with copies of the first sample whose labels are all ignored: they add no token.
    Positions are the samples' position_ids (restarting per document when the sample has them).
    """
    from torch.utils.data import DataLoader, DistributedSampler

    mesh = mesh if mesh is not None else Mesh(1, 1)
    if len(samples) == 0:
        raise ValueError("evaluate_positions: expected at least one sample, got none; fix: pass held-out samples "
                         "(the training app: --eval-samples 1 or more)")
    if max_positions is None:
        max_positions = max(len(s["input_ids"]) for s in samples)
    if len(samples) % mesh.world_size:
        first = samples[0]
        filler = {"input_ids": first["input_ids"], "labels": torch.full_like(first["labels"], IGNORE_INDEX)}
        samples = [samples[i] for i in range(len(samples))] + [filler] * (-len(samples) % mesh.world_size)
    edges = bucket_edges(buckets, max_positions)
    nb = len(edges) - 1
    sampler = DistributedSampler(samples, num_replicas=mesh.world_size, rank=mesh.rank, shuffle=False)
    loader = UlyssesSPDataLoaderAdapter(DataLoader(samples, batch_size=1, sampler=sampler), mesh.sp_rank,
                                        mesh.sp_group, mesh.sp, collective_device(mesh.sp_group),
                                        pad_token_id=pad_token_id, ring_size=mesh.ring_size)
    sums = torch.zeros(nb, dtype=torch.float64)
    counts = torch.zeros(nb, dtype=torch.int64)
    transform = logits_transform(model, zero3_whole)
    was_training = model.training
    model.eval()
    try:
        for batch in loader:
            losses = _token_losses(model, batch, transform)  # [bs sl_l]
            valid = batch["shift_labels"] != IGNORE_INDEX
            positions = batch["position_ids"][valid]
            if positions.numel() and int(positions.max()) >= int(edges[-1]):
                raise ValueError(f"evaluate_positions: expected positions below max_positions={max_positions}, "
                                 f"got {int(positions.max())}; fix: pass max_positions >= the longest sample")
            index = torch.bucketize(positions, edges, right=True) - 1  # edges[i] <= p < edges[i+1]
            sums.index_add_(0, index, losses[valid].double())
            counts.index_add_(0, index, torch.ones_like(index))
    finally:
        model.train(was_training)
    if mesh.world_size > 1:
        device = collective_device()
        sums, counts = sums.to(device), counts.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(counts)
    return PositionLoss(edges, sums.cpu(), counts.cpu())


def buckets_arg(text: str) -> int | str:
    """``--buckets``: "log2" or a positive int (validated by :func:`bucket_edges`)."""
    return text if text == "log2" else int(text)


def add_arguments(parser) -> None:
    """``ds-ulysses eval MODEL_DIR``: loss by position of a saved HF model, one process, no SP."""
    parser.add_argument("model", metavar="MODEL_DIR", help="local HF model directory (e.g. from ds-ulysses export)")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per held-out sequence")
    parser.add_argument("--samples", type=int, default=2, help="held-out sequences (the first of the corpus)")
    parser.add_argument("--buckets", type=buckets_arg, default="log2",
                        help="log2 (positions 0, 1, 2-3, 4-7, ...) or N positions per bucket")
    parser.add_argument("--data", nargs="+", metavar="FILE", help="text or JSONL files; default: the stdlib source")
    parser.add_argument("--tokenizer", help="local HF tokenizer directory; default: bytes")
    parser.add_argument("--out", default=None, help="directory for loss_by_position.csv/.png (default: MODEL_DIR/eval)")


def run_command(args) -> int:
    """The same held-out samples as examples/train.py's evaluation (same data, tokenizer, seq-len)."""
    import sys

    from transformers import AutoModelForCausalLM

    from .corpus import PackedSamples, file_texts, load_tokenizer, stdlib_texts

    try:
        tokenizer = load_tokenizer(args.tokenizer)
        texts = (lambda: file_texts(args.data)) if args.data else stdlib_texts
        samples = PackedSamples(texts, tokenizer, args.seq_len, args.samples)
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    result = evaluate_positions(model, samples, None, args.buckets, pad_token_id=tokenizer.pad_id)
    out = Path(args.out) if args.out else Path(args.model) / "eval"
    csv_path = result.write_csv(out / "loss_by_position.csv")
    result.plot(out / "loss_by_position.png",
                f"held-out loss by position ({args.samples} x {args.seq_len} tokens, no SP)")
    print(f"eval: mean loss {result.overall:.4f} over {int(result.counts.sum())} held-out tokens -> {csv_path}")
    return 0
