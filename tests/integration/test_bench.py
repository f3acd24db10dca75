"""The benchmark harness stays runnable: a tiny side-by-side run produces every table row (no timing asserts)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_ulysses import cli
from ds_ulysses.planner import parse_size
from benchmarks import bench, maxseq, measure, mode_tables, report, suites, tiled
from benchmarks import launch as launcher, records as bench_records
from benchmarks.arms import NOISE_ARM
from benchmarks.bench import parse_bytes
from benchmarks.records import launch_cpu, launch_time
from benchmarks.report import ratio_rows, ulysses_min_bytes
from benchmarks.tables import target_verdict, verdict

TINY = ["--model", "vocab=128", "--model", "hidden=32", "--model", "intermediate=64", "--model", "layers=2",
        "--model", "heads=4", "--model", "kv_heads=2"]


@pytest.mark.slow
def test_tiny_side_by_side_run_writes_the_tables(tmp_path, capsys):
    out, report = tmp_path / "runs.jsonl", tmp_path / "report"
    code = cli.main(["bench", "--seq-len", "64", "--sp", "2", "--reps", "1", "--steps", "1", "--warmup", "0",
                     "--no-warm-up", "--impl", "deepspeed", "ours", *TINY, "--out", str(out), "--report",
                     str(report), "--timeout", "240"])
    assert code == 0
    printed = capsys.readouterr().out
    for arm in (NOISE_ARM, "ours"):
        assert f"| {arm} | 64 | 2 |" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["name"] for r in records] == ["deepspeed", NOISE_ARM, "ours"]
    assert all(r["machine"] == bench_records.machine() and r["commit"] == bench_records.commit() for r in records)
    assert all(0 <= r["stolen"] <= 1 for r in records)  # the host's share of the CPUs while each launch ran
    # minor page faults per measured step and rank, summed over the ranks per step in the launch line
    assert all(len(k["minor_faults"]) == len(k["times"]) for r in records for k in r["ranks"])
    assert bench_records.launch_faults(records[0]) == sum(k["minor_faults"][0] for k in records[0]["ranks"])
    assert f"faults {bench_records.launch_faults(records[-1]) / 1e6:.2f}M/step" in printed
    losses = {r["name"]: r["ranks"][0]["losses"][0] for r in records}
    assert losses["ours"] == pytest.approx(losses["deepspeed"], rel=1e-5)  # same model, same samples
    assert losses[NOISE_ARM] == losses["deepspeed"]
    # the first repetition profiles one refill cycle (sp steps) per launch: every phase is a time per step, the
    # adapter's refill among them
    for rec in records:
        profile = rec["ranks"][0]["profile"]
        assert all(value >= 0 for key, value in profile.items() if key != "zero_bwd")
        assert profile["steps"] == 2 and profile["total"] > 0 and profile["adapter"] > 0
    # each rank's CPU time per measured step: some work, and no more than its process's threads could do
    for rec in records:
        for r in rec["ranks"]:
            assert len(r["cpu_times"]) == len(r["times"]) == 1
            assert 0 < r["cpu_times"][0] <= r["times"][0] * os.cpu_count()
    text = (report / "results.md").read_text()
    assert "| ours | 64 | 2 |" in text and "time ratios deepspeed[again] / deepspeed" in text
    # the collective tap sees both implementations: DeepSpeed 4 all-to-alls + 1 all_gather per layer, ours 2
    # all-to-alls per layer and 2 all_gathers per forward (2 layers here: 1 per layer)
    comm = {line.split(" | ")[0]: line for line in text.splitlines() if " | 64 | 2 | " in line and "all_to_all" in line}
    assert "| 1 all_gather, 4 all_to_all_single |" in comm["| deepspeed"]
    assert "| 1 all_gather, 2 all_to_all_single |" in comm["| ours"]
    assert (report / "memory_vs_seq.png").stat().st_size > 0 and (report / "time_vs_seq.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.long  # make test-long: every loop; make test launches the engine loop (the tiny side-by-side run)
@pytest.mark.parametrize("loop,title", [
    ("trainer", "Through Transformers' Trainer"),
    ("accelerate", "In a plain Accelerate loop"),
    ("trl", "Through TRL's SFTTrainer")])
def test_the_trainer_accelerate_and_trl_loops_run_each_arm_through_them(tmp_path, capsys, monkeypatch, loop, title):
    """`--loop trainer`, `accelerate` and `trl`: DeepSpeed's arm through the documented parallelism_config
    without ds_ulysses loaded, ours through install() and the section, ours-dropin through install() and the
    same parallelism_config (in the Accelerate loop with DeepSpeed's user's loss from the logits, which it
    keeps; in TRL's SFTTrainer with its fused LM head); the same model and samples give the same loss at every
    step, each arm's attention layers run (and are counted), one more refill cycle is profiled phase by phase,
    and each loop's records are reported apart from the engine loop's."""
    # a launch of a few seconds reads a steal spell from one second of the host's: no pair is screened out here, so
    # each arm's ratio and work rows are there to count (the screen is tested on records of its own)
    monkeypatch.setattr(bench_records, "STEAL_LIMIT", 1.0)
    out, report_dir = tmp_path / "runs.jsonl", tmp_path / "report"
    assert cli.main(["bench", "--loop", loop, "--seq-len", "64", "--sp", "2", "--reps", "1", "--steps", "2",
                     "--warmup", "0", "--no-warm-up", "--no-noise", "--impl", "deepspeed", "ours-dropin", "ours",
                     *TINY, "--out", str(out), "--report", str(report_dir), "--timeout", "240"]) == 0
    records = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["deepspeed", "ours", "ours-dropin"]
    assert all(r["kind"] == loop and r["loop"] == loop for r in records.values())
    for name, rec in records.items():
        ranks = rec["ranks"]
        assert all(r["ds_ulysses_loaded"] == (name != "deepspeed") for r in ranks), name
        assert all(len(r["times"]) == 2 and len(r["phases"][0]) == 4 and r["attn_forward_calls"] == 4 for r in ranks)
        assert all(len(r["cpu_times"]) == 2 and min(r["cpu_times"]) > 0 for r in ranks), name
        assert all(len(r["minor_faults"]) == 2 for r in ranks), name
        assert ranks[0]["losses"] == pytest.approx(records["deepspeed"]["ranks"][0]["losses"], rel=1e-5), name
        # the profiled refill cycle (steps 3 and 4), after the measured two (neither their losses nor their counts
        # hold it): the regions sit where the engine loop's do, so each phase ran, ZeRO's rest of the backward aside
        for r in ranks:
            assert len(r["losses"]) == 2, name
            profile = r["profile"]
            assert profile["steps"] == 2, (name, profile)
            busy = [k for k in ("adapter", "positions", "a2a_fwd", "core_fwd", "layers_fwd", "loss_fwd", "a2a_bwd",
                                "core_bwd", "layers_bwd", "loss_bwd", "optimizer") if profile[k] <= 0]
            assert not busy, (name, busy, profile)
    # per layer forward, DeepSpeed: 4 all-to-alls (q, k, v, out); ours: 2 (2 steps x 2 layers here)
    assert records["deepspeed"]["ranks"][0]["attn_forward"]["calls"]["all_to_all_single"] == 16
    assert records["ours"]["ranks"][0]["attn_forward"]["calls"]["all_to_all_single"] == 8
    printed = capsys.readouterr().out
    assert "| ours-dropin | 64 | 2 |" in printed and "| ours | 64 | 2 |" in printed
    text = (report_dir / "results.md").read_text()
    assert title in text
    # its ratio row, its work row, its measurement and its profile, in the loop's section only
    assert text.count("| ours-dropin | 64 | 2 |") == 4
    assert "| *ours-dropin - deepspeed* | 64 | 2 |" in text
    assert text.count("Work per step (CPU seconds of all ranks):") == 1


@pytest.mark.slow
def test_the_attention_layer_alone_runs_every_arm_on_the_same_inputs(tmp_path, capsys):
    """`--layer-iters`: DeepSpeed's wrapper, its noise arm and ours, one launch per repetition; the outputs
    (DeepSpeed's `[bs, sl, hc*hs]`, ours `[bs, sl, hc, hs]`) and q's gradient agree across the arms."""
    out = tmp_path / "runs.jsonl"
    assert cli.main(["bench", "--layer-iters", "1", "--reps", "2", "--seq-len", "256", "--sp", "2", "--out", str(out),
                     "--timeout", "240"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rep"] for r in records] == [0, 1]
    assert all(r["result"]["same_output_and_grad"] and r["result"][f"{NOISE_ARM}_s"] > 0 for r in records)
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| 256 | 2 | 2 x 1 |") and row.endswith("| yes |")


def test_layer_table_judges_the_median_ratio_against_the_noise_arm():
    def record(ds, again, ours):
        return {"kind": "layer", "seq_len": 4096, "sp": 2, "result": {
            "iters": 8, "same_output_and_grad": True, "deepspeed_s": ds, f"{NOISE_ARM}_s": again, "ours_s": ours}}

    # ratios 0.90, 0.85, 0.95 (median 0.90); the noise arm 2% and 4% off DeepSpeed: ±4%, so 0.90 is met
    records = [record(1.0, 1.02, 0.90), record(2.0, 1.92, 1.70), record(1.0, 1.0, 0.95)]
    rows = mode_tables.format_layer(records).splitlines()
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    assert cells[2:] == ["3 x 8", "1.000 [1.000-2.000]", "0.950 [0.900-1.700]", "**0.90 [0.85-0.95]**", "±4.0%",
                         "met", "yes"]
    # a launch without the noise arm (before it existed) leaves the verdict unjudged against noise
    old = record(1.0, 1.0, 1.1)
    del old["result"][f"{NOISE_ARM}_s"]
    cells = [c.strip() for c in mode_tables.format_layer([old]).splitlines()[-1].strip("|").split("|")]
    assert cells[6:8] == ["-", "missed (noise not measured)"]


def test_ulysses_minimum_counts_gqa_and_replication():
    model = {"hidden": 256, "heads": 8, "kv_heads": 2}
    # q and output: 256 each; k and v: 2 heads x 32 each -> 640 floats per token, S/sp tokens
    assert ulysses_min_bytes(model, 4096, 2) == 640 * 2048 * 4
    # sp 4 > 2 KV heads: each KV head goes to two ranks
    assert ulysses_min_bytes(model, 4096, 4) == (512 + 4 * 32 * 2) * 1024 * 4


def test_sizes_and_bad_arguments(capsys):
    assert (parse_size("4096"), parse_size("16K"), parse_size("1m")) == (4096, 16384, 1 << 20)
    assert (parse_bytes("3G"), parse_bytes("2.5GiB"), parse_bytes("512M"), parse_bytes("100")) == (
        3 << 30, 5 << 29, 512 << 20, 100)
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="memory budget"):
        parse_bytes("much")
    assert cli.main(["bench", "--variant", "bad"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
    assert cli.main(["bench", "--variant", 'x={"tiled_mlp": {"enabeld": true}}']) == 2
    assert cli.main(["bench", "--max-seq=0G"]) == 2
    assert "positive memory budget" in capsys.readouterr().err
    assert cli.main(["bench", "--cycles", "0"]) == 2
    assert "--cycles must be 1 or more" in capsys.readouterr().err
    assert cli.main(["bench", "--max-seq", "2G", "--max-seq-steps", "0"]) == 2
    assert "--max-seq-steps must be 1 or more" in capsys.readouterr().err
    assert cli.main(["bench", "--loop", "trainer", "--impl", "deepspeed", "deepspeed-alst"]) == 2
    assert "--loop trainer runs the arms" in capsys.readouterr().err
    assert cli.main(["bench", "--loop", "trainer", "--max-seq", "2G"]) == 2
    assert "does not combine with --max-seq" in capsys.readouterr().err
    assert cli.main(["bench", "--loop", "accelerate", "--impl", "deepspeed-alst"]) == 2
    assert "--loop accelerate runs the arms" in capsys.readouterr().err
    assert cli.main(["bench", "--loop", "trl", "--packed-docs", "4"]) == 2
    assert "--loop trl trains TRL's samples as they come, got --packed-docs 4" in capsys.readouterr().err


def test_a_launch_counts_its_fastest_refill_cycle_of_the_slowest_ranks_steps():
    def record(sp, *rank_times):
        return {"sp": sp, "ranks": [{"times": list(t)} for t in rank_times]}

    # sp 2, two cycles: slowest rank per step is 5, 4 | 3, 2 -> cycle means 4.5 and 2.5
    assert launch_time(record(2, [5, 1, 3, 2], [1, 4, 1, 1])) == 2.5
    # a partial cycle (3 steps at sp 2) or fewer steps than sp: every step counts
    assert launch_time(record(2, [6, 1, 2], [1, 1, 1])) == 3.0
    assert launch_time(record(4, [2, 4], [3, 1])) == 3.5
    assert math.isnan(launch_time(record(2, [])))


def test_a_loops_samples_feed_every_step_a_fresh_shard_with_one_refill_spare():
    from benchmarks.recipes import loop_dataset

    for sp, world, steps, refills in [(2, 2, 5, 4), (2, 4, 4, 3), (4, 4, 9, 4), (1, 2, 3, 4)]:
        data = loop_dataset({"sp": sp, "seq_len": 8, "packed_docs": 2}, 50, world, steps)
        # each rank takes one sample a refill and spends it on sp steps: ceil(steps / sp) refills and one more
        assert len(data) == world * refills
        assert len({tuple(d["input_ids"].tolist()) for d in data}) == len(data)
        assert all(d["input_ids"].shape == (8,) and (d["position_ids"] == 0).sum() == 2 for d in data)


def test_a_launchs_work_is_its_ranks_cpu_seconds_summed_over_its_least_busy_refill_cycle():
    def record(sp, *rank_cpu):
        return {"sp": sp, "ranks": [{"times": [9.0] * len(c), "cpu_times": list(c)} for c in rank_cpu]}

    # sp 2, two cycles: the ranks' sum per step is 6, 5 | 4, 3 -> cycle means 5.5 and 3.5
    assert launch_cpu(record(2, [5, 1, 3, 2], [1, 4, 1, 1])) == 3.5
    assert launch_cpu(record(2, [6, 1, 2], [1, 1, 1])) == 4.0  # a partial cycle: every step counts
    # a record from before the ranks took their CPU time has no work figure (not a zero)
    assert launch_cpu({"sp": 2, "ranks": [{"times": [1.0, 1.0]}, {"times": [1.0, 1.0]}]}) is None


def test_work_table_judges_the_median_ratio_against_the_noise_arms_work_and_skips_older_records():
    def launch(name, rep, cpu, run="b"):
        ranks = [{"times": [cpu], "peak": 1} for _ in range(2)]
        if cpu is not None:
            for r in ranks:
                r["cpu_times"] = [cpu / 2]
        return {"name": name, "run": run, "rep": rep, "seq_len": 4096, "sp": 1, "model": {}, "ranks": ranks}

    records = [launch("deepspeed", "x", None, run="a"), launch("ours", "x", None, run="a")]  # before the CPU time
    for rep, (ds, again, dropin, ours) in enumerate([(10.0, 10.2, 9.9, 8.0), (10.0, 9.9, 10.1, 8.2),
                                                     (10.0, 10.1, 10.0, 7.9)]):
        records += [launch("deepspeed", rep, ds), launch(NOISE_ARM, rep, again), launch("ours-dropin", rep, dropin),
                    launch("ours", rep, ours)]
    table = report.format_work(records)
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:])}
    assert rows["ours-dropin"][5:] == ["10.00", "10.00", "**1.00 [0.99-1.01]**", "±2.0%", "same within noise", "3"]
    assert rows["ours"][5:] == ["10.00", "8.00", "**0.80 [0.79-0.82]**", "±2.0%", "less work", "3"]


def test_verdicts_are_claimed_only_beyond_the_noise():
    assert verdict(0.97, 0.05) == "same within noise"
    assert verdict(0.90, 0.05) == "faster" and verdict(1.10, 0.05) == "slower"
    assert target_verdict(0.90, 0.03, 0.95) == "met"
    assert target_verdict(0.94, 0.03, 0.95) == "undecided (target within noise)"
    assert target_verdict(1.00, 0.03, 0.95).startswith("missed")


def test_a_ratio_row_shows_the_seconds_and_bytes_of_the_launches_it_pairs():
    def launch(name, run, step, peak):
        return {"name": name, "run": run, "rep": 0, "seq_len": 4096, "sp": 1, "model": {},
                "ranks": [{"times": [step], "peak": peak, "steps_peak": peak, "losses": [1.0], "phases": [],
                           "attn_forward_calls": 1, "attn_forward": {"calls": {}, "sent": {}, "off_rank": {}},
                           "backward": {"calls": {}}, "refill": {"received": {}, "calls": {}}, "refills": 1}]}

    # DeepSpeed ran in two runs, the arm only in the second: its row compares 4 s with 3 s, never 2 s
    records = [launch("deepspeed", "a", 2.0, 100), launch("deepspeed", "b", 4.0, 300), launch("ours", "b", 3.0, 150)]
    (row,) = ratio_rows(records)
    assert (row["ds_time"], row["time"], row["time_ratio"]) == (4.0, 3.0, 0.75)
    assert (row["ds_peak"], row["peak"], row["mem_ratio"]) == (300, 150, 0.5)


def _step_launch(name, rep, step, stolen, run="a"):
    """An engine-loop launch record of one rank: one step of `step` s; `stolen` None as before 2026-11-29."""
    rec = {"name": name, "run": run, "rep": rep, "seq_len": 4096, "sp": 1, "model": {},
           "ranks": [{"times": [step], "cpu_times": [step], "peak": 100, "steps_peak": 100, "losses": [1.0],
                      "phases": [], "attn_forward_calls": 1, "attn_forward": {"calls": {}, "sent": {}, "off_rank": {}},
                      "backward": {"calls": {}}, "refill": {"received": {}, "calls": {}}, "refills": 1}]}
    return rec if stolen is None else {**rec, "stolen": stolen}


def test_a_pair_with_a_launch_in_a_steal_spell_is_left_out_and_named():
    launch = _step_launch
    steps = {"deepspeed": [10.0, 10.0, 10.0, 10.0], NOISE_ARM: [10.2, 13.0, 9.9, 10.1],
             "ours-dropin": [9.0, 9.1, 12.0, 8.9]}
    # rep 1: the noise arm in a spell; rep 2: DeepSpeed's launch, so both of its pairs; rep 3: no figure (an
    # older record) counts as calm, as does a launch at the limit
    stolen = {0: {}, 1: {NOISE_ARM: 0.12}, 2: {"deepspeed": 0.30}, 3: {NOISE_ARM: bench_records.STEAL_LIMIT}}
    records = [launch(name, rep, times[rep], stolen[rep].get(name, None if rep == 3 else 0.01))
               for rep in range(4) for name, times in steps.items()]
    by = {(r["rep"], r["name"]): r for r in records}
    calm = bench_records.calm
    assert not calm(by[1, NOISE_ARM]) and calm(by[3, NOISE_ARM]) and calm(by[3, "deepspeed"])
    rows = {r["name"]: r for r in ratio_rows(records)}
    assert rows[NOISE_ARM]["times"] == pytest.approx([1.02, 1.01])
    assert rows[NOISE_ARM]["noise_time"] == pytest.approx(0.02)
    assert rows["ours-dropin"]["times"] == pytest.approx([0.9, 0.91, 0.89]) and rows["ours-dropin"]["reps"] == 3
    assert rows["ours-dropin"]["time_verdict"] == "faster"  # 13.0 in the noise arm would have hidden it
    work = {line.split(" | ")[0]: line for line in report.format_work(records).splitlines()}
    assert work["| ours-dropin"].endswith("| ±2.0% | less work | 3 |")
    (note,) = report.spell_notes(records)
    assert "more than 5% of the CPUs" in note
    assert note.endswith(f"{NOISE_ARM} at 4K, sp 1: 2 of 4; ours-dropin at 4K, sp 1: 1 of 4.")
    assert note in report.format_run(records) and report.spell_notes(records[:3]) == []


def test_the_screened_tables_judge_a_configuration_on_the_launches_that_recorded_the_stolen_share(tmp_path):
    steps = {"deepspeed": 10.0, NOISE_ARM: 10.1, "ours": 8.5}
    # run "a" predates the figure: its noise-arm pair 30% off (a spell nobody could see) widens the pooled noise
    older = [_step_launch(name, 0, 13.0 if name == NOISE_ARM else step, None) for name, step in steps.items()]
    newer = [_step_launch(name, rep, step * (1 + rep / 100), 0.01, run="b")
             for rep in range(3) for name, step in steps.items()]
    pooled = {r["name"]: r for r in ratio_rows(older + newer)}
    assert pooled["ours"]["noise_time"] == pytest.approx(0.3) and pooled["ours"]["time_verdict"] == "same within noise"
    assert bench_records.screened(older + newer) == newer
    alone = {r["name"]: r for r in ratio_rows(bench_records.screened(older + newer))}
    assert alone["ours"]["noise_time"] == pytest.approx(0.01) and alone["ours"]["reps"] == 3
    assert alone["ours"]["time_verdict"] == "faster"
    (text, noise, ratios) = report._screened_sections(older + newer)
    assert "since 2026-11-29" in text and noise == report.format_noise(newer) and ratios == report.format_ratios(newer)
    assert report._screened_sections(older) == []  # nothing screened: no section
    assert report._screened_sections(newer) == []  # everything screened: the tables above already are
    report.write_report(older + newer, tmp_path)
    assert ratios in (tmp_path / "results.md").read_text()


def test_host_env_reaches_every_rank_and_its_launches_are_a_configuration_of_their_own(tmp_path, monkeypatch,
                                                                                       capsys):
    """--host-env (and an allocator setting the ranks inherit) is set in every rank, named in each record, and
    keeps its launches out of the default environment's pairs: an allocator moves a step by more than the arms do."""
    seen = []

    class Rank:  # a rank that writes its result at once and says which environment it got
        def __init__(self, argv, env, **_):
            seen.append(env)
            Path(f"{argv[-1]}.rank{env['RANK']}.json").write_text(json.dumps({"rank": env["RANK"]}))
            self.pid, self.returncode = os.getpid(), 0

        def poll(self):
            return 0

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    spec = {"impl": "deepspeed", "seq_len": 64, "host_env": {"THP_MEM_ALLOC_ENABLE": "1"}}
    with monkeypatch.context() as m:
        m.setattr(launcher, "subprocess", SimpleNamespace(Popen=Rank, STDOUT=subprocess.STDOUT))
        assert launcher.launch(spec, 2, tmp_path) == [{"rank": "0"}, {"rank": "1"}]
    assert [(env["RANK"], env["THP_MEM_ALLOC_ENABLE"], env["GLIBC_TUNABLES"]) for env in seen] == [
        ("0", "1", "glibc.malloc.mmap_max=0"), ("1", "1", "glibc.malloc.mmap_max=0")]

    def launched(spec, world, workdir, timeout):
        raise RuntimeError(f"launched with {spec['host_env']}")

    monkeypatch.setattr(suites, "launch", launched)
    out = tmp_path / "runs.jsonl"
    suites.run_suite([64], [2], ["deepspeed"], reps=1, steps=1, warmup=0, out=out, noise=False, profile_reps=0,
                    warm_up=False, log=lambda line: None, host_env={"THP_MEM_ALLOC_ENABLE": "1"})
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    both = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0", "THP_MEM_ALLOC_ENABLE": "1"}
    assert record["host_env"] == both and record["error"] == f"launched with {both}"

    thp = {"THP_MEM_ALLOC_ENABLE": "1"}
    plain = [_step_launch(name, rep, step, 0.01) for rep in range(2)
             for name, step in (("deepspeed", 10.0), (NOISE_ARM, 10.0), ("ours", 9.0))]
    huge = [{**_step_launch(name, rep, step, 0.3 if (rep, name) == (2, "ours") else 0.01, run="b"), "host_env": thp}
            for rep in range(3) for name, step in (("deepspeed", 8.0), (NOISE_ARM, 8.0), ("ours", 8.8))]
    rows = {(r["name"], r["model"]): r for r in ratio_rows(plain + huge)}
    assert rows["ours", ""]["times"] == pytest.approx([0.9, 0.9])
    assert rows["ours", "env THP_MEM_ALLOC_ENABLE=1"]["times"] == pytest.approx([1.1, 1.1])
    assert report.spell_notes(plain + huge)[0].endswith("ours at 4K, sp 1, env THP_MEM_ALLOC_ENABLE=1: 1 of 3.")
    assert bench_records.setup_key({"model": {"vocab": 64}, "host_env": thp}) == "vocab=64 env THP_MEM_ALLOC_ENABLE=1"
    assert "| ours | 4K | 1 | - | env THP_MEM_ALLOC_ENABLE=1 | 8.00 | 8.80 |" in report.format_ratios(plain + huge)

    assert cli.main(["bench", "--host-env", "OMP_NUM_THREADS=4"]) == 2
    assert "--host-env cannot set OMP_NUM_THREADS: the harness sets it" in capsys.readouterr().err
    assert cli.main(["bench", "--host-env", "THP_MEM_ALLOC_ENABLE=1", "--max-seq", "2G"]) == 2
    assert "got it with --max-seq" in capsys.readouterr().err


@pytest.mark.parametrize("warm_up_fails", [False, True])
def test_the_warm_up_launch_is_not_recorded_and_its_failure_does_not_void_the_suite(tmp_path, monkeypatch,
                                                                                     warm_up_fails):
    """The first launch (first arm, first configuration, not profiled) only warms the machine: it is not
    written down, and the suite goes on whether it ran or failed (here every recorded launch fails)."""
    specs = []

    def launch(spec, world, workdir, timeout):
        specs.append(spec)
        if len(specs) == 1 and not warm_up_fails:
            return []
        raise RuntimeError(f"benchmark launch of {spec['impl']} failed; log tail:\nterminate called")

    monkeypatch.setattr(suites, "launch", launch)
    printed = []
    out = tmp_path / "runs.jsonl"
    records = suites.run_suite([64, 128], [2], ["deepspeed"], reps=1, steps=1, warmup=0, out=out, noise=False,
                              profile_reps=1, log=printed.append)
    assert records == []
    outcome = "FAILED (terminate called), going on" if warm_up_fails else "not recorded"
    assert f"deepspeed S=    64 sp=2: machine warm-up launch, {outcome}" in printed[0]
    assert [(s["seq_len"], s["profile"]) for s in specs] == [(64, False), (64, True), (128, True)]
    # the suite went on to its recorded launches, which failed in turn and were written down as such
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["name"], r["seq_len"]) for r in written] == [("deepspeed", 64), ("deepspeed", 128)]
    assert all("terminate called" in r["error"] for r in written)


@pytest.mark.parametrize("per_token,base,budget", [(1000, 10_000, 3_000_000), (37, 123_457, 400_000),
                                                    (100, 1_000_000, 1_409_650)])
def test_max_seq_search_finds_the_longest_length_that_fits(per_token, base, budget):
    """A probe whose peak grows linearly with S (plus a jump at one length, as a tile count change
    makes): the search returns the longest multiple of the granularity that fits, and measured the
    next one not to."""
    def peak(s):
        return base + per_token * s + (50_000 if s > 4096 else 0)

    probed = []

    def probe(s):
        probed.append(s)
        return peak(s) if peak(s) <= budget else None

    found = maxseq.search(probe, budget, 256, log=lambda _: None)
    truth = max(s for s in range(256, 1 << 20, 256) if peak(s) <= budget)
    assert found["max_seq"] == truth and found["next_failed"] == truth + 256
    assert len(probed) <= 13 and probed.count(truth) == 2 and truth + 256 in probed


def test_max_seq_search_is_not_led_far_off_by_a_flat_start_or_a_peak_steeper_than_its_line():
    """Peaks nearly flat over the two short probes (runtime, not activations) and then steepening (a
    recipe's 3-step RSS on this machine): the line is followed at most EXTRAPOLATE times past the
    longest fit, and a bracket the line overshoots is halved, not walked down one length at a time."""
    def peak(s):
        return 1_400 + s // 1024 + (s // 1024 - 4) ** 2 * 3 if s > 4096 else 1_400 + s // 1024

    budget = 2_500
    truth = max(s for s in range(1024, 1 << 20, 1024) if peak(s) <= budget)
    probed = []

    def probe(s):
        probed.append(s)
        return peak(s) if peak(s) <= budget else None

    found = maxseq.search(probe, budget, 1024, log=lambda _: None)
    assert found["max_seq"] == truth and found["next_failed"] == truth + 1024
    fitted = [s for s in probed if peak(s) <= budget]
    assert all(s <= maxseq.EXTRAPOLATE * max(f for f in fitted if f < s) for s in probed[2:])
    assert len(set(probed)) <= 8 and probed.count(truth) == 2, probed


@pytest.mark.parametrize("per_token,cap,truth", [(40, 16384, 16384), (40, 40960, 21504), (40, 1024, 1024)])
def test_max_seq_search_probes_nothing_past_its_cap(per_token, cap, truth):
    """With a cap the search never probes past it: an arm that fits at the cap answers the cap (probed twice,
    no failure measured), one that does not is searched below it as without a cap."""
    budget = 1_000_000

    def peak(s):
        return 100_000 + per_token * s

    probed = []

    def probe(s):
        probed.append(s)
        return peak(s) if peak(s) <= budget else None

    found = maxseq.search(probe, budget, 1024, log=lambda _: None, cap=cap)
    assert found["max_seq"] == truth and max(probed) <= cap and probed.count(truth) == 2, probed
    assert found["next_failed"] == (None if truth == cap else truth + 1024)


@pytest.mark.parametrize("lucky", [1, 2])
def test_max_seq_search_believes_a_length_only_when_it_fits_every_time(lucky):
    """Peak RSS moves by a few % between identical launches: the `lucky` lengths just above the
    longest reliable one fit on their first probe only. The search probes its answer again, drops a
    length that fails then, and answers the longest length that fitted every time it was probed."""
    budget, per_token = 1_000_000, 40

    def steady(s):
        return 100_000 + per_token * s

    truth = max(s for s in range(1024, 1 << 20, 1024) if steady(s) <= budget)
    first_lucky = {truth + 1024 * i for i in range(1, lucky + 1)}
    probed, answered = [], []

    def probe(s):
        lucky_now = s in first_lucky and s not in probed
        probed.append(s)
        peak = budget if lucky_now else steady(s)
        answered.append([s, peak if peak <= budget else None])
        return answered[-1][1]

    found = maxseq.search(probe, budget, 1024, log=lambda _: None)
    assert found["max_seq"] == truth and found["next_failed"] == truth + 1024, probed
    assert probed.count(truth) == 2 and first_lucky <= set(probed) and found["probes"] == answered


@pytest.mark.parametrize("op", tiled.OPS)
def test_tiled_operations_agree_with_deepspeeds(op):
    """The tiled benchmark's pairs compute the same values and gradients in both libraries."""
    result = tiled.run(op, 384, 1, {"hidden": 64, "intermediate": 128, "vocab": 512})
    assert result["same_output_and_grads"], result
    assert {len(result["times"][arm]) for arm in ("deepspeed", NOISE_ARM, "ours")} == {1}  # the noise arm ran too
    assert 0 < result["ours_tensor_peak"] <= result["deepspeed_tensor_peak"] == result[f"{NOISE_ARM}_tensor_peak"]


def test_tensor_peak_is_the_most_tensor_bytes_alive_at_once():
    def call():
        a = torch.empty(1024)  # 4 KiB
        b = torch.empty(2048)  # 8 KiB: 12 KiB alive
        del a
        c = torch.empty(512)  # 2 KiB: 10 KiB alive
        del b, c

    before = torch.empty(4096)  # alive throughout, freed inside: the peak counts from the start
    assert measure.tensor_peak(call) == 12 * 1024
    assert measure.tensor_peak(lambda: before.resize_(0)) == 0


def test_tiled_table_judges_the_median_ratio_against_the_noise_arm():
    """Per process ours / DeepSpeed, median over processes; the noise is the largest |again / DS - 1|."""
    def record(ds, again, ours):
        mib = 2**20  # memory: ours 10% above DeepSpeed in every process, DeepSpeed's two arms equal
        result = {"op": "tiled_mlp", "seq_len": 2048, "shards": 8, "iters": 4, "same_output_and_grads": True,
                  "deepspeed_s": ds, f"{NOISE_ARM}_s": again, "ours_s": ours,
                  "deepspeed_peak": 10 * mib, f"{NOISE_ARM}_peak": 10 * mib, "ours_peak": 11 * mib}
        if ds == 2.0:  # one process measured tensor peaks: ours 12 bytes above DeepSpeed, its two arms 4 apart
            result.update({"deepspeed_tensor_peak": mib, f"{NOISE_ARM}_tensor_peak": mib + 4,
                           "ours_tensor_peak": mib + 12})
        return {"kind": "tiled", "op": "tiled_mlp", "seq_len": 2048, "result": result}

    # time ratios 0.80, 0.90, 0.85 (median 0.85); noise 1.05 and 0.97 against DeepSpeed: ±5%
    table = mode_tables.format_tiled([record(1.0, 1.05, 0.80), record(2.0, 1.94, 1.80), record(1.0, 1.0, 0.85)])
    row = table.splitlines()[-1]
    assert "| 3 x 4 |" in row and "**0.85 [0.80-0.90]**" in row and "±5.0%" in row
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[8] == "met" and cells[11] == "**1.100 [1.100-1.100]**" and cells[13] == "missed by +10.0%"
    assert cells[14:19] == ["1", "1.00 [1.00-1.00]", "**+12 [+12, +12]**", "4", "missed by +12 B"]


def test_tiled_ops_picks_the_operations_a_tiled_suite_launches(tmp_path, monkeypatch):
    """`--tiled-ops` reaches the suite, which launches those operations only, each length and repetition."""
    launched = []

    def fake_launch(spec, world, workdir, timeout):
        launched.append((spec["op"], spec["seq_len"]))
        return [{"shards": 1, "iters": 2, "same_output_and_grads": True,
                 **{f"{arm}_{key}": 1.0 for arm in ("deepspeed", NOISE_ARM, "ours") for key in ("s", "peak")}}]

    def parse(argv):
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        return parser.parse_args(argv)

    monkeypatch.setattr(suites, "launch", fake_launch)
    out = tmp_path / "runs.jsonl"
    bench.run_command(parse(["--tiled-iters", "2", "--reps", "2", "--seq-len", "2K", "4K", "--tiled-ops", "stc_mlp",
                             "--out", str(out)]))
    assert launched == [("stc_mlp", 2048), ("stc_mlp", 4096)] * 2
    assert [json.loads(line)["op"] for line in out.read_text().splitlines()] == ["stc_mlp"] * 4
    with pytest.raises(SystemExit):
        parse(["--tiled-iters", "2", "--tiled-ops", "attention"])


def test_max_seq_table_compares_arms_searched_with_the_same_steps_per_probe():
    """A one-step search of DeepSpeed (records from before probes ran several steps carry no
    ``probe_steps``) is not the baseline of a three-step search of ours: each is its own row group."""
    def rec(name, max_seq, steps=None):
        r = {"kind": "maxseq", "name": name, "budget": 2 << 30, "sp": 2, "max_seq": max_seq,
             "next_failed": max_seq + 1024, "probes": [[max_seq, 1 << 30], [max_seq + 1024, None]], "seconds": 60.0}
        return r if steps is None else {**r, "probe_steps": steps}

    table = mode_tables.format_maxseq([rec("deepspeed", 8192), rec("deepspeed", 4096, 3), rec("ours", 16384, 3)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [(r[2], r[3], r[4], r[6]) for r in rows] == [
        ("1", "deepspeed", "8K", "**1.00**"), ("3", "deepspeed", "4K", "**1.00**"), ("3", "ours", "16K", "**4.00**")]


def test_max_seq_table_marks_a_search_that_reached_its_cap():
    capped = {"kind": "maxseq", "name": "ours[tiles]", "budget": 2 << 30, "sp": 2, "probe_steps": 3, "max_seq": 40960,
              "cap": 40960, "next_failed": None, "probes": [[40960, 1 << 30], [40960, 1 << 30]], "seconds": 60.0}
    table = mode_tables.format_maxseq([capped, {**capped, "name": "ours", "max_seq": 20480, "next_failed": 21504}])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [(r[3], r[4], r[5]) for r in rows] == [("ours", "20K", "21K"),
                                                  ("ours[tiles]", ">= 40K (the search's cap)", "-")]


def test_max_seq_table_and_plot_show_each_arms_latest_search(monkeypatch, tmp_path):
    """An arm searched again (a rerun at a later commit) replaces its earlier search in both the table
    and the plot, so the plot's lines are the table's rows."""
    def rec(name, max_seq, peak):
        return {"kind": "maxseq", "name": name, "budget": 2 << 30, "sp": 2, "probe_steps": 3, "max_seq": max_seq,
                "next_failed": max_seq + 1024, "probes": [[max_seq, peak], [max_seq + 1024, None]], "seconds": 60.0}

    records = [rec("ours", 21504, 1 << 30), rec("deepspeed", 5120, 1 << 30), rec("ours", 19456, 3 << 29)]
    table = mode_tables.format_maxseq(records)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [(r[3], r[4]) for r in rows] == [("deepspeed", "5K"), ("ours", "19K")]
    drawn = {}

    def keep(fig, ax, ylabel, path):
        drawn.update({line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in ax.get_lines()
                      if not line.get_label().startswith("_")})
        return path

    monkeypatch.setattr(mode_tables, "save_seq_plot", keep)
    mode_tables.plot_maxseq(records, tmp_path / "max_seq.png")
    assert drawn == {"deepspeed sp=2: 5120": [(5120, 1.0)], "ours sp=2: 19456": [(19456, 1.5)]}


def test_profile_sets_arms_side_by_side_only_within_a_run():
    """DeepSpeed profiled in two runs (one on a slow day) and the drop-in in one: the drop-in's
    difference row is taken against DeepSpeed of its own run, and each run has its own rows."""
    phases = ("adapter", "positions", "a2a_fwd", "a2a_bwd", "a2a_collective", "core_fwd", "core_bwd",
              "layers_fwd", "layers_bwd", "loss_fwd", "loss_bwd", "zero_bwd", "optimizer")

    def rec(name, run, core, step):
        profile = {**dict.fromkeys(phases, 0.0), "core_fwd": core, "total": core}
        return {"kind": "step", "name": name, "run": run, "seq_len": 4096, "sp": 2,
                "ranks": [{"times": [step, step], "profile": profile}]}

    table = report.format_profile([rec("deepspeed", "slow", 9.0, 10.0), rec("deepspeed", "fast", 5.0, 6.0),
                                   rec("ours-dropin", "fast", 4.0, 5.5)])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    attention = 10  # arm, S, sp, docs, model, run, steps profiled, adapter, gather, all-to-alls, attention kernel
    assert [(r[0], r[5], r[attention]) for r in rows] == [
        ("deepspeed", "fast", "5.000"), ("ours-dropin", "fast", "4.000"),
        ("*ours-dropin - deepspeed*", "fast", "*-1.000*"), ("deepspeed", "slow", "9.000")]
    assert rows[2][-2:] == ["*-1.00*", "*-0.50*"]


def test_a_profile_of_several_steps_gives_seconds_per_step():
    """A refill cycle of two steps, the adapter's refill in the first only: every phase is its time over the
    cycle halved (as the measured step time is a cycle's mean step), and the record says two steps."""
    from types import SimpleNamespace

    from benchmarks.profile import phases_of

    def region(name, micros, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent, sequence_nr=-1,
                               time_range=SimpleNamespace(elapsed_us=lambda: micros))

    events = []
    for adapter_us in (3000, 10):  # the refill, then a step served from the adapter's shards
        forward = region("bench.forward", 500)
        events += [region("bench.adapter", adapter_us), forward, region("bench.decoder", 400, forward),
                   region("bench.backward", 900), region("bench.step", 200)]
    seconds = phases_of(events, steps=2)
    assert seconds["steps"] == 2
    assert seconds["adapter"] == pytest.approx(3010e-6 / 2)
    assert seconds["layers_fwd"] == pytest.approx(400e-6) and seconds["loss_fwd"] == pytest.approx(100e-6)
    assert seconds["zero_bwd"] == pytest.approx(900e-6) and seconds["optimizer"] == pytest.approx(200e-6)
    assert seconds["total"] == pytest.approx((3010 + 2 * (500 + 900 + 200)) * 1e-6 / 2)


def test_profile_counts_a_checkpointed_layers_forward_once():
    """A layer under non-reentrant checkpointing runs its forward again inside the backward (TRL's default,
    DeepSpeed's ALST recipe, our checkpoint offload). Its attention regions there are backward time: counted
    in the forward phases too, the attention's forward came out larger than the decoder that holds it and
    the rest of the layers negative (the regions nest in the forward, so the split can never be)."""
    from torch.autograd.profiler import record_function
    from torch.utils.checkpoint import checkpoint

    from benchmarks.profile import phase_seconds

    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256, requires_grad=True)

    def layer(h):
        with record_function("bench.ulysses"), record_function("bench.core"):
            return (h @ weight).relu() @ weight

    seconds: dict = {}
    with phase_seconds(seconds):
        with record_function("bench.forward"):
            with record_function("bench.decoder"):
                hidden = checkpoint(layer, x, use_reentrant=False)
            loss = hidden.square().mean()
        with record_function("bench.backward"):
            loss.backward()
    assert seconds["core_fwd"] > 0 and seconds["layers_fwd"] >= 0 and seconds["a2a_fwd"] >= 0, seconds
    # the recomputation is in the backward phases: the backward holds the forward once more and the matmuls' grads
    assert seconds["core_bwd"] + seconds["layers_bwd"] + seconds["zero_bwd"] > seconds["core_fwd"], seconds
    forward = sum(seconds[k] for k in ("adapter", "positions", "a2a_fwd", "core_fwd", "layers_fwd", "loss_fwd"))
    backward = sum(seconds[k] for k in ("a2a_bwd", "core_bwd", "layers_bwd", "loss_bwd", "zero_bwd"))
    assert forward + backward == pytest.approx(seconds["total"], rel=1e-9)


def test_records_say_on_what_machine_and_at_what_commit_they_were_measured():
    """Sessions here have run on different CPU models: every record carries the CPU, the CPUs it could use
    and the checkout's commit, and the report lists them (records from before say "not recorded")."""
    stamped = bench_records.stamp()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    assert stamped["machine"].startswith(f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, ")
    root = Path(bench.__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode == 0:
        assert stamped["commit"].split("+")[0] == head.stdout.strip()
    else:
        assert stamped["commit"] == "unknown"
    old = {"kind": "step", "date": "2026-11-24 11:08"}
    new = {"kind": "tiled", "date": "2026-11-26 13:00", "machine": "Some CPU, 2 CPUs, 23.4 GiB", "commit": "abc1234"}
    rows = report.format_provenance([new, old, dict(new, kind="layer")]).splitlines()[2:]
    assert rows == ["| not recorded | not recorded | step | 1 | 2026-11-24 11:08 to 2026-11-24 11:08 |",
                    "| Some CPU, 2 CPUs, 23.4 GiB | `abc1234` | layer, tiled | 2 "
                    "| 2026-11-26 13:00 to 2026-11-26 13:00 |"]


def test_a_record_is_marked_changed_by_code_not_by_the_results_it_is_appended_to(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n")
    (tmp_path / "benchmarks" / "rank.py").write_text("STEPS = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    head = bench_records.commit(tmp_path)
    assert len(head) >= 7 and "+" not in head
    (tmp_path / "benchmarks" / "results" / "runs.jsonl").write_text("{}\n{}\n")  # a suite appends its records
    assert bench_records.commit(tmp_path) == head
    (tmp_path / "benchmarks" / "rank.py").write_text("STEPS = 2\n")  # the measured code changes
    assert bench_records.commit(tmp_path) == head + "+changes"


def test_gpu_benchmark_times_each_step_of_real_training():
    """benchmarks.gpu.longest's step loop trains: three steps of its loop leave the same weights as three
    plain SGD steps, and each step comes back as [forward, backward, optimizer] seconds, with how much the
    counters it is given (on a GPU, what torch's allocators did) grew in it."""
    from benchmarks.gpu.longest import timed_steps

    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 1), torch.randn(8, 4)
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = argparse.Namespace(backward=lambda loss: loss.backward(),
                                step=lambda: (optimizer.step(), optimizer.zero_grad()))
    syncs, totals = [], iter([0, 2, 2, 3, 3, 4])  # a running total, read before and after each step

    phases, losses, grew = timed_steps(engine, lambda: model(x).square().mean(), 3, lambda: syncs.append(1),
                                       lambda: {"blocks": next(totals)})
    want = []
    for _ in range(3):
        loss = ref(x).square().mean()
        want.append(float(loss.detach()))
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert losses == pytest.approx(want, rel=1e-6)
    assert all(torch.allclose(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert len(phases) == 3 and all(len(step) == 3 and min(step) >= 0 for step in phases)
    assert len(syncs) == 3 * 4  # the device is waited for before every clock read
    assert grew == [{"blocks": 2}, {"blocks": 1}, {"blocks": 1}]


def test_gpu_benchmark_side_by_side_prints_ratios_and_stamps_every_trial(monkeypatch, tmp_path, capsys):
    """--at runs each implementation at each length (steps passed on), records every trial with where and
    when, and prints ours / deepspeed for time (last step) and memory, and what the allocators did in a first
    step; a failed trial prints why. The diagnostic arm without the offload is run when asked for."""
    from benchmarks.gpu import longest

    asked = []

    def fake_launch(impl, model, seq_len, attn, timeout, steps, device, profile=False):
        asked.append((impl, seq_len, steps, device))
        if seq_len > 1000 and impl == "deepspeed":
            return {"impl": impl, "model": model, "seq_len": seq_len, "ok": False, "why": "CUDA out of memory"}
        seconds = {"ours": 3.0, "deepspeed": 4.0, "ours-no-offload": 2.0}[impl]
        first = {"pinned_allocs": 16, "pinned_alloc_s": 2.5, "cuda_mallocs": 40, "alloc_retries": 0} if impl == "ours" \
            else {"pinned_allocs": 0, "pinned_alloc_s": 0.0, "cuda_mallocs": 0, "alloc_retries": 0}
        return {"impl": impl, "model": model, "seq_len": seq_len, "ok": True, "seconds": seconds,
                "first_step_s": 2 * seconds, "tokens_per_s": seq_len / seconds,
                "peak_gib": {"ours": 4.0, "deepspeed": 8.0, "ours-no-offload": 6.0}[impl],
                "steps": [[seconds, seconds, 0.0]] + [[seconds, 0.0, 0.0]] * (steps - 1),
                "allocators_per_step": [first] + [{}] * (steps - 1)}

    monkeypatch.setattr(longest, "launch", fake_launch)
    out = tmp_path / "gpu.jsonl"
    assert longest.main(["--model", "llama-3.2-1b", "--at", "512", "2048", "--steps", "2", "--out", str(out)]) == 0
    assert asked == [("ours", 512, 2, "cuda"), ("deepspeed", 512, 2, "cuda"), ("ours", 2048, 2, "cuda"),
                     ("deepspeed", 2048, 2, "cuda")]
    printed = capsys.readouterr().out
    assert "ours / deepspeed: time 0.75, memory 0.50" in printed
    assert "ours 3.00 s/step (steps 6.00, 3.00: 2.50 s creating 16 pinned host blocks, 40 cudaMalloc), 4.0 GiB" \
        in printed
    assert "deepspeed failed (CUDA out of memory)" in printed
    assert "deepspeed 4.00 s/step (steps 8.00, 4.00), 8.0 GiB" in printed  # the allocators did nothing: not printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    commit = bench_records.commit()
    assert len(records) == 4 and all(r["commit"] == commit and r["steps_per_trial"] == 2 for r in records)
    asked.clear()
    assert longest.main(["--impl", "ours-no-offload", "deepspeed", "--at", "512", "--out", str(out)]) == 0
    assert asked == [("ours-no-offload", 512, 3, "cuda"), ("deepspeed", 512, 3, "cuda")]
    assert "ours-no-offload / deepspeed: time 0.50, memory 0.75" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        longest.main(["--at", "512", "--steps", "0", "--out", str(out)])


def test_gpu_benchmark_repeats_alternate_the_arms_and_judge_ratios_against_deepspeeds_own_noise(
        monkeypatch, tmp_path, capsys):
    """--repeat N runs every arm N times, DeepSpeed's twice per repetition (the noise arm), the order reversed
    every other repetition; each ratio is paired within its repetition, printed as median [range], and
    judged against the noise arm's largest deviation, as the CPU benchmark judges. --profile profiles the
    last repetition's trials of the compared arms only."""
    from benchmarks.gpu import longest

    asked, profiled = [], []
    # per launch, in the order the arms run: ours, deepspeed, again | again, deepspeed, ours | ours, deepspeed, again
    took = iter([5.0, 6.0, 6.06, 6.0, 5.94, 5.5, 6.0, 6.0, 6.0])

    def fake_launch(impl, model, seq_len, attn, timeout, steps, device, profile=False):
        asked.append(impl)
        profiled.append(profile)
        seconds = next(took)
        return {"impl": impl, "model": model, "seq_len": seq_len, "ok": True, "seconds": seconds,
                "first_step_s": seconds, "tokens_per_s": seq_len / seconds,
                "peak_gib": {"ours": 8.0, "deepspeed": 12.0}[impl], "steps": [[seconds, 0.0, 0.0]] * steps}

    monkeypatch.setattr(longest, "launch", fake_launch)
    out = tmp_path / "gpu.jsonl"
    assert longest.main(["--at", "512", "--repeat", "3", "--profile", "--out", str(out)]) == 0
    assert asked == ["ours", "deepspeed", "deepspeed", "deepspeed", "deepspeed", "ours", "ours", "deepspeed",
                     "deepspeed"]
    assert profiled == [False] * 6 + [True, True, False]  # the last repetition's arms, not its noise arm
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["arm"], r["rep"]) for r in records] == [
        ("ours", 0), ("deepspeed", 0), (NOISE_ARM, 0), (NOISE_ARM, 1), ("deepspeed", 1), ("ours", 1),
        ("ours", 2), ("deepspeed", 2), (NOISE_ARM, 2)]
    printed = capsys.readouterr().out
    assert "ours 5.50 [5.00-6.00] s/step, 8.0 [8.0-8.0] GiB over 3 trials" in printed
    # ratios 5/6, 5.5/5.94, 6/6: median 0.93, beyond the noise arm's 1.0% (6.06/6); memory 0.67 every time, noise 0
    assert "ours / deepspeed: time 0.93 [0.83-1.00] (faster, noise 1.0%), memory 0.67 [0.67-0.67] (less, noise 0.0%)" \
        in printed
    with pytest.raises(SystemExit):
        longest.main(["--repeat", "2", "--out", str(out)])  # a search has nothing to repeat side by side


def test_gpu_benchmark_profile_tables_give_each_operator_its_own_time_once():
    """The profile's per-operator table: every call of an operator counted, its self time only (a linear
    map's matmul is aten::mm's, not aten::linear's as well), so the operators' times add up to the
    phase's total; and two arms' tables compared operator by operator, the largest differences first."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu.kernels import differences, operator_times

    a, w, small = torch.randn(384, 384), torch.randn(384, 384), torch.randn(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, w)
        torch.nn.functional.linear(a, w)
        small.add(1)
    table = operator_times(prof.key_averages(), gpu=False)
    operators = table["operators"]
    assert operators["aten::mm"][1] == 4  # three direct calls and the linear map's
    by_hand = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000
    assert table["ms"] == pytest.approx(by_hand, abs=0.01) == pytest.approx(sum(ms for ms, _ in operators.values()),
                                                                           abs=0.01)
    assert operators.get("aten::linear", [0.0])[0] < operators["aten::mm"][0] / 4  # its matmul is not its own
    assert list(operator_times(prof.key_averages(), gpu=False, top=1)["operators"]) == ["aten::mm"]

    ours = {"forward": {"ms": 10.0, "operators": {"aten::mm": [8.0, 2], "aten::add": [2.0, 1]}}}
    theirs = {"forward": {"ms": 7.0, "operators": {"aten::mm": [6.0, 2], "aten::copy_": [1.0, 1]}}}
    compared = differences(ours, theirs)
    assert compared["forward"] == (10.0, 7.0, [("aten::add", 2.0, 0.0), ("aten::mm", 8.0, 6.0),
                                               ("aten::copy_", 0.0, 1.0)])
    assert compared["backward"] == compared["optimizer"] == (0.0, 0.0, [])


def test_gpu_benchmark_search_doubles_then_bisects_and_prints_length_ratios(monkeypatch, tmp_path, capsys):
    """Without --at, each implementation's longest S: doubled from --start until a trial fails, then bisected
    to --resolution; every arm's length is printed against deepspeed's."""
    from benchmarks.gpu import longest

    fits = {"ours": 3000, "ours-no-offload": 2200, "deepspeed": 1500}  # the longest S each "trains"
    asked = []

    def fake_launch(impl, model, seq_len, attn, timeout, steps, device, profile=False):
        asked.append((impl, seq_len))
        if seq_len > fits[impl]:
            return {"impl": impl, "model": model, "seq_len": seq_len, "ok": False, "why": "CUDA out of memory"}
        return {"impl": impl, "model": model, "seq_len": seq_len, "ok": True, "seconds": 1.0, "first_step_s": 1.0,
                "tokens_per_s": float(seq_len), "peak_gib": 1.0, "steps": [[1.0, 0.0, 0.0]] * steps}

    monkeypatch.setattr(longest, "launch", fake_launch)
    argv = ["--impl", "ours", "ours-no-offload", "deepspeed", "--start", "512", "--resolution", "256",
            "--out", str(tmp_path / "gpu.jsonl")]
    assert longest.main(argv) == 0
    # ours: 512, 1024, 2048 train, 4096 does not; then 3072 (no), 2560, 2816 (yes): within 256 of 3072
    assert [s for impl, s in asked if impl == "ours"] == [512, 1024, 2048, 4096, 3072, 2560, 2816]
    printed = capsys.readouterr().out
    assert "ours:      2,816 tokens" in printed and "deepspeed:      1,280 tokens" in printed
    assert "ratio ours / deepspeed: 2.20x the length" in printed
    assert "ratio ours-no-offload / deepspeed: 1.60x the length" in printed  # 2048 against 1280


@pytest.mark.long  # make test-long; make test runs the GPU benchmark's tables, repeats and search on stand-in trials
@pytest.mark.parametrize("arm", ["ours", "ours-no-offload"])
def test_gpu_benchmark_arms_train_the_same_model_the_same_way_on_cpu(tmp_path, capsys, monkeypatch, arm):
    """--device cpu runs benchmarks.gpu.longest's real trials (fresh processes, ZeRO-3 with DeepSpeed's CPU
    AdamW) on the tiny model: ours (tiled MLP, tiled loss, checkpoint offload) or ours with checkpointing in
    place of the offload, and DeepSpeed's ALST recipe start from the same weights and data, so each of their
    steps has the same loss, the first before any update and the next after the same update. The model is built
    as on a GPU, partitioned while built, and initialised as Transformers initialises it."""
    from benchmarks.gpu import longest
    from tests.support.distributed import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # not the harness's fixed default
    out = tmp_path / "gpu.jsonl"
    assert longest.main(["--device", "cpu", "--model", "tiny", "--at", "256", "--steps", "2", "--profile",
                         "--impl", arm, "deepspeed", "--out", str(out)]) == 0
    trials = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(trials) == sorted([arm, "deepspeed"])
    assert all(t["ok"] and t["device"] == "cpu" and len(t["steps"]) == 2 and t["peak_gib"] > 0.1
               for t in trials.values()), trials
    assert all(t["built_partitioned"] for t in trials.values())  # under zero.Init, as on a GPU
    want = trials["deepspeed"]["losses"]
    # Transformers' initialisation (std 0.02): the logits are about uniform over the vocabulary
    assert want[0] == pytest.approx(math.log(32000), rel=0.05)
    assert trials[arm]["losses"] == pytest.approx(want, rel=1e-5)
    printed = capsys.readouterr().out
    assert f"{arm} / deepspeed: time" in printed
    for impl, t in trials.items():  # one more step, profiled phase by phase; matmuls run in each pass
        assert set(t["profile"]) == {"forward", "backward", "optimizer"}, impl
        assert all(t["profile"][phase]["operators"]["aten::mm"][0] > 0 for phase in ("forward", "backward")), impl
    assert f"S=256, {arm} against deepspeed, self time per operator in ms" in printed
