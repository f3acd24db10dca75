#!/usr/bin/env bash
# Reproduces benchmarks/results/ (results.md, *.png, runs.jsonl): about 7 hours on 2 CPU cores (sp 4 runs 4 processes on them).
# Every `bench` call appends its launches to runs.jsonl; the last call rebuilds the report from all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/runs.jsonl}
bench() { DS_ACCELERATOR=cpu "$PY" -m benchmarks.bench --out "$OUT" "$@"; }

# 1. mechanism (deepspeed vs ours-dropin) and product (deepspeed vs ours), with the noise arm (DeepSpeed
#    launched twice per repetition) and one profiled step per launch of the first repetition; a launch's
#    time is its fastest of --cycles adapter refill cycles
bench --seq-len 4K 8K --sp 2 --reps 3 --cycles 3
bench --seq-len 4K 8K --sp 4 --reps 3 --cycles 2
bench --seq-len 16K --sp 4 --reps 3 --cycles 1  # 4 processes of a 16K step on 2 cores: one cycle per launch
# 2. at 16K also DeepSpeed with every ALST tool it has (ArcticTraining's setup)
bench --seq-len 16K --sp 2 --reps 3 --cycles 2 --impl deepspeed deepspeed-alst ours-dropin ours
# 2b. the product path at 32K (DeepSpeed's recipe peaks near 10.5 GiB per rank: nothing else may run
#     beside it on a 24 GiB machine), one refill cycle per launch (a step is ~1.5 min), no profile
bench --seq-len 32K --sp 2 --reps 3 --cycles 1 --impl deepspeed ours --profile-reps 0
# 2c. the mechanism path at 32K, with its own noise arm (about 50 minutes)
bench --seq-len 32K --sp 2 --reps 3 --cycles 1 --impl deepspeed ours-dropin --profile-reps 0
# 2d. what trim_host_heap is worth: our defaults with and without it, against DeepSpeed's recipe
bench --seq-len 16K --sp 2 --reps 3 --cycles 2 --impl deepspeed ours --variant notrim='{"trim_host_heap": false}' --no-noise
bench --seq-len 16K --sp 4 --reps 3 --cycles 1 --impl deepspeed ours --variant notrim='{"trim_host_heap": false}' --no-noise
# 3. TiledMLP and sequence_tiled_compute against DeepSpeed's at equal shards (one rank's tokens)
bench --tiled-iters 6 --reps 3 --seq-len 2K 4K
bench --tiled-iters 6 --reps 6 --seq-len 2K 4K --tiled-ops tiled_mlp stc_mlp  # the MLP rows' 1% needs nine processes
# 4. the longest sequence whose step fits 2.5 GiB of RSS per rank, three recipes, sp 2
bench --max-seq 2.5G --sp 2 --impl deepspeed deepspeed-alst ours
bench --max-seq 2.5G --sp 2 --impl deepspeed --variant notrim='{"trim_host_heap": false}'  # ours without trim_host_heap
# 5. the memory planner's anchor: DeepSpeed at S=64 (its RSS is the runtime and the model states alone)
bench --seq-len 64 --sp 2 4 --reps 1 --impl deepspeed --no-noise --no-warm-up --profile-reps 0
# 5b. the same arms through Transformers' Trainer: DeepSpeed's through its parallelism_config, ours through the
#     section (and ours-dropin: install() behind that parallelism_config), with the noise arm; then the section
#     with our untiled loss, the mechanism (about 75 minutes)
MECHANISM='mechanism={"tiled_loss": {"enabled": false}, "trim_host_heap": false}'
bench --loop trainer --seq-len 4K 8K --sp 2 --reps 3 --cycles 2
bench --loop trainer --seq-len 16K --sp 2 --reps 3 --cycles 1
bench --loop trainer --seq-len 8K --sp 4 --reps 3 --cycles 1
bench --loop trainer --seq-len 4K 8K --sp 2 --reps 3 --cycles 2 --impl deepspeed --variant "$MECHANISM"
bench --loop trainer --seq-len 16K --sp 2 --reps 3 --cycles 1 --impl deepspeed --variant "$MECHANISM"
# 5c. the same in a plain Accelerate loop: DeepSpeed's through its parallelism_config and Accelerate's ALST
#     example's loss, ours-dropin install() in front of that code, ours the section; with our untiled loss
#     as a variant (about 40 minutes)
bench --loop accelerate --seq-len 4K 8K --sp 2 --reps 3 --cycles 2 --variant "$MECHANISM"
bench --loop accelerate --seq-len 16K --sp 2 --reps 3 --cycles 1 --variant "$MECHANISM"
# 5d. the Trainer's arms through TRL's SFTTrainer (SFTConfig's defaults, gradient checkpointing included, in fp32;
#     about 50 minutes)
bench --loop trl --seq-len 4K --sp 2 --reps 3 --cycles 2
bench --loop trl --seq-len 16K --sp 2 --reps 3 --cycles 1
# 6. the attention layer alone: DeepSpeed's wrapper, its noise arm and ours interleaved (about 10 minutes)
bench --layer-iters 8 --reps 3 --seq-len 4K 8K 16K --sp 2 4

"$PY" -m benchmarks.bench --out "$OUT" --report-only --report benchmarks/results
