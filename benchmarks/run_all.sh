#!/usr/bin/env bash
# Reproduces benchmarks/results/ (results.md, *.png, runs.jsonl): about 90 minutes on 2 CPU cores.
# Every `bench` call appends its launches to runs.jsonl; the last call rebuilds the report from all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/runs.jsonl}
bench() { DS_ACCELERATOR=cpu "$PY" -m benchmarks.bench --out "$OUT" "$@"; }
LOSS8='loss-shards-8={"tiled_loss": {"enabled": true, "shards": 8}}'

# 1. mechanism (deepspeed vs ours-dropin) and product (deepspeed vs ours), sp 2 and sp 4
bench --seq-len 4K --sp 2 --reps 3
bench --seq-len 4K --sp 4 --reps 1
bench --seq-len 16K --sp 2 --reps 2 --variant "$LOSS8"
# 2. the attention layer alone, both wrappers interleaved per iteration in one process group
bench --layer-iters 12 --seq-len 4K --sp 2
bench --layer-iters 8 --seq-len 8K --sp 2
# 3. product on packed batches: 8 documents per sample
bench --seq-len 16K --sp 2 --packed-docs 8 --impl deepspeed ours --reps 2
# 4. issue 5: peak memory with each ALST switch off/on (ours only)
bench --seq-len 16K --sp 2 --reps 1 --steps 1 --impl \
  --variant 'none={"tiled_loss": {"enabled": false}}' \
  --variant 'tiled_loss={"tiled_loss": {"enabled": true, "shards": 8}}' \
  --variant 'tiled_mlp={"tiled_loss": {"enabled": false}, "tiled_mlp": {"enabled": true}}' \
  --variant 'ckpt_offload={"tiled_loss": {"enabled": false}, "activation_checkpoint_offload": {"enabled": true}}' \
  --variant 'all={"tiled_loss": {"enabled": true, "shards": 8}, "tiled_mlp": {"enabled": true}, "activation_checkpoint_offload": {"enabled": true}}'
# 5. scaling: sp 1 and sp 2 over S
bench --seq-len 2K 4K 8K --sp 1 --reps 1
bench --seq-len 2K 8K --sp 2 --reps 1
# 6. the planner's intercept: runtime + model states at a negligible S
bench --seq-len 64 --sp 1 2 --reps 1 --impl deepspeed

"$PY" -m benchmarks.bench --out "$OUT" --report-only --report benchmarks/results
