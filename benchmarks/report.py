"""Markdown tables and PNG plots from benchmark records (``ds-ulysses bench --report DIR``).

Every ratio is ours / DeepSpeed within one repetition of one run (same configuration, launched
back to back in rotating order), reported as the median over repetitions with its spread
(``[min-max]``). The noise of a configuration is what the same code does to the ratio: the
``deepspeed[again]`` arm against ``deepspeed``, ``n = max |ratio - 1|`` over its repetitions. A
verdict is claimed only beyond the noise (:mod:`benchmarks.tables`). The launches are paired and screened
by :mod:`benchmarks.records`; the other modes' tables are :mod:`benchmarks.mode_tables`'.

A pair with a launch during which the host stole more than :data:`benchmarks.records.STEAL_LIMIT` of the
machine's CPU time (a steal spell, :func:`benchmarks.records.calm`; recorded since 2026-11-29) is left out
of ratios, noise and work, and named (:func:`spell_notes`). A launch from before carries no figure and
counts as calm, so the report also judges each configuration on its screened launches alone
(:func:`benchmarks.records.screened`), beside the pooled tables.

Beside the step time, the work per step (the CPU seconds of all ranks, :func:`benchmarks.records.launch_cpu`;
recorded since 2026-11-29) is paired and judged against the noise arm the same way (:func:`format_work`).

Targets (issue 15): mechanism (``ours-dropin``) time and memory <= 1.0 at every length; product
(``ours``, defaults) time <= 0.95 and memory <= 0.6 at S >= 16K; packed product time <= 0.7.

The Trainer's, the plain Accelerate loop's and TRL's SFTTrainer's launches (``--loop trainer``,
``accelerate`` and ``trl``, records of those kinds) are paired, judged and tabled the same way, each apart
from the engine loop's (the ``kind`` arguments).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ds_ulysses.constants import GIB

from .arms import MODEL_DEFAULTS, NOISE_ARM
from .mode_tables import format_layer, format_maxseq, format_tiled, plot_maxseq
from .records import (STEAL_LIMIT, calm_pair, every_pair, launch_cpu, launch_peak, launch_time, noise_of, paired,
                      paired_launches, screened, setup_key, summarize)
from .tables import STYLES, md_table, noise_text, save_seq_plot, seq_text, spread, target_verdict, verdict

__all__ = ["format_group", "format_run", "write_report", "ratio_rows", "spell_notes", "ulysses_min_bytes", "targets",
           "format_ratios", "format_work", "format_profile", "format_noise", "format_summary", "format_comm",
           "planner_rows", "format_provenance", "PROFILE_COLUMNS"]

PRODUCT_MIN_SEQ = 16384  # the product targets are stated at S = 16K and 32K


def targets(name: str, seq_len: int, packed: int):
    """(time target, memory target) of an arm at (S, packed); None where the issue sets none."""
    if name == "ours-dropin":
        return 1.0, 1.0
    if name == "ours":
        if packed:
            return 0.7, None
        return (0.95, 0.6) if seq_len >= PRODUCT_MIN_SEQ else (None, None)
    return None, None


def ulysses_min_bytes(model: dict, seq_len: int, sp: int, itemsize: int = 4) -> float:
    """Send-buffer bytes per rank per layer forward that Ulysses cannot avoid: q and the output at
    ``S/sp x h``, k and v at ``S/sp x kv_heads x hs`` (at least ``sp`` heads once KV heads must be
    replicated, sp > kv_heads)."""
    m = {**MODEL_DEFAULTS, **(model or {})}
    hs = m["hidden"] // m["heads"]
    per_token = 2 * m["heads"] * hs + 2 * max(m["kv_heads"], sp) * hs
    return per_token * seq_len / sp * itemsize


# -- ratios, noise, verdicts ------------------------------------------------------------------------
LOOP_TITLES = {"trainer": "Through Transformers' Trainer (`--loop trainer`)",
               "accelerate": "In a plain Accelerate loop (`--loop accelerate`)",
               "trl": "Through TRL's SFTTrainer (`--loop trl`)"}


def spell_notes(records: list[dict], kind: str = "step") -> list[str]:
    """A sentence naming the pairs :func:`benchmarks.records.paired_launches` left out because a launch ran in a
    steal spell, per arm and configuration, or none when no pair was."""
    left = []
    for (name, s, sp, packed, model), pairs in sorted(every_pair(records, kind).items(), key=_row_order):
        out = sum(not calm_pair(*pair) for pair in pairs)
        if out:
            left.append(f"{name} at {seq_text(s)}, sp {sp}{f', {packed} docs' if packed else ''}"
                        f"{f', {model}' if model else ''}: {out} of {len(pairs)}")
    if not left:
        return []
    return [f"Pairs left out of the ratios, noise and work figures, as the host stole more than {STEAL_LIMIT:.0%} of "
            f"the CPUs while one of their launches ran (a steal spell): " + "; ".join(left) + "."]


def _row_order(item) -> tuple:
    """Rows by model, packing, S, sp, then arm, from a ``((name, S, sp, packed, model), ...)`` item."""
    (name, s, sp, packed, model), _ = item
    return model, packed, s, sp, name


def ratio_rows(records: list[dict], kind: str = "step") -> list[dict]:
    """One row per (arm, configuration) with a DeepSpeed pair: ratios, spread, noise, verdicts. Its seconds
    and GiB are medians over the same paired launches as its ratios, so a configuration measured in several
    runs (DeepSpeed in more repetitions than the arm) shows both sides of the same repetitions."""
    pairs = paired(records, kind)
    launches = paired_launches(records, kind)
    summary = summarize(records, kind)
    rows = []
    for (name, s, sp, packed, model), values in sorted(pairs.items(), key=_row_order):
        config = (s, sp, packed, model)
        noise = noise_of(pairs, config)
        n_t, n_m = (noise[0], noise[1]) if noise else (None, None)
        times, mems = [t for t, _ in values], [m for _, m in values]
        t, m = statistics.median(times), statistics.median(mems)
        t_target, m_target = targets(name, s, packed)
        ds, ours = summary.get(("deepspeed", *config)), summary.get((name, *config))
        arm_launches = launches[(name, *config)]

        def median_of(measure, side):
            return statistics.median(measure(pair[side]) for pair in arm_launches)
        rows.append({
            "name": name, "S": s, "sp": sp, "packed": packed, "model": model, "reps": len(values),
            "time_ratio": t, "times": times, "mem_ratio": m, "mems": mems, "noise_time": n_t, "noise_mem": n_m,
            "time_verdict": verdict(t, n_t), "mem_verdict": verdict(m, n_m, "smaller", "larger"),
            "time_target": t_target, "mem_target": m_target,
            "time_target_verdict": target_verdict(t, n_t, t_target),
            "mem_target_verdict": target_verdict(m, n_m, m_target),
            "ds_time": median_of(launch_time, 1), "time": median_of(launch_time, 0),
            "ds_peak": median_of(launch_peak, 1), "peak": median_of(launch_peak, 0),
            "ds_loss": ds["loss"] if ds else float("nan"), "loss": ours["loss"] if ours else float("nan"),
        })
    return rows


def _target_text(target, text) -> str:
    return "-" if target is None else f"<= {target:g}: {text}"


def format_ratios(records: list[dict], kind: str = "step") -> str:
    rows = []
    for r in ratio_rows(records, kind):
        rows.append([r["name"], seq_text(r["S"]), r["sp"], r["packed"] or "-", r["model"] or "default",
                     f"{r['ds_time']:.2f}", f"{r['time']:.2f}", f"**{spread(r['times'])}**",
                     noise_text(r["noise_time"]),
                     r["time_verdict"], _target_text(r["time_target"], r["time_target_verdict"]),
                     f"{r['ds_peak'] / GIB:.2f}", f"{r['peak'] / GIB:.2f}", f"**{spread(r['mems'], 3)}**",
                     noise_text(r["noise_mem"]), r["mem_verdict"],
                     _target_text(r["mem_target"], r["mem_target_verdict"]),
                     f"{r['ds_loss']:.4f} / {r['loss']:.4f}", r["reps"]])
    return md_table(["arm", "S", "sp", "docs", "model", "DS s/step", "arm s/step", "time ratio [min-max]", "noise",
                   "vs DS", "time target", "DS peak GiB", "arm peak GiB", "memory ratio [min-max]", "noise", "vs DS",
                   "memory target", "first loss DS / arm", "reps"], rows)


def format_work(records: list[dict], kind: str = "step") -> str:
    """The CPU seconds per step of all ranks (:func:`benchmarks.records.launch_cpu`), arm / DeepSpeed within each
    repetition, judged against the noise arm's own ratios as the step time is: the work each library does
    per step, which neither a peer's wait nor the host's stolen time enters. Launches measured before the
    ranks took their CPU time (2026-11-29) are left out."""
    pairs = {}
    for key, launches in paired_launches(records, kind).items():
        measured = [(launch_cpu(rec), launch_cpu(ds)) for rec, ds in launches]
        measured = [(arm, ds) for arm, ds in measured if arm is not None and ds is not None]
        if measured:
            pairs[key] = measured
    rows = []
    for (name, s, sp, packed, model), measured in sorted(pairs.items(), key=_row_order):
        ratios = [arm / ds for arm, ds in measured]
        same = pairs.get((NOISE_ARM, s, sp, packed, model))
        noise = max(abs(arm / ds - 1) for arm, ds in same) if same else None
        ratio = statistics.median(ratios)
        rows.append([name, seq_text(s), sp, packed or "-", model or "default",
                     f"{statistics.median(ds for _, ds in measured):.2f}",
                     f"{statistics.median(arm for arm, _ in measured):.2f}", f"**{spread(ratios)}**",
                     noise_text(noise), verdict(ratio, noise, "less work", "more work"), len(ratios)])
    return md_table(["arm", "S", "sp", "docs", "model", "DS CPU s/step", "arm CPU s/step", "work ratio [min-max]",
                   "noise", "vs DS", "reps"], rows)


def _worked(records: list[dict], kind: str) -> bool:
    return any(rec.get("kind", "step") == kind and launch_cpu(rec) is not None
               for rec in records if "error" not in rec and rec.get("ranks"))


# -- the per-phase profile ---------------------------------------------------------------------------
PROFILE_COLUMNS = (  # (header, phases summed)
    ("adapter", ("adapter",)),
    ("position gather", ("positions",)),
    ("all-to-alls fwd+bwd (collective)", ("a2a_fwd", "a2a_bwd")),
    ("attention kernel fwd+bwd", ("core_fwd", "core_bwd")),
    ("other layers fwd+bwd", ("layers_fwd", "layers_bwd")),
    ("head + loss fwd+bwd", ("loss_fwd", "loss_bwd")),
    ("backward: ZeRO, accumulation", ("zero_bwd",)),
    ("optimizer", ("optimizer",)),
)


def _profile_cells(p: dict) -> list[str]:
    cells = []
    for header, keys in PROFILE_COLUMNS:
        value = sum(p[k] for k in keys)
        if keys == ("a2a_fwd", "a2a_bwd"):
            cells.append(f"{value:.3f} ({p['a2a_collective']:.3f})")
        else:
            cells.append(f"{value:.3f}")
    return cells


def format_profile(records: list[dict], kind: str = "step") -> str:
    """Seconds per step and phase of the profiled steps (mean over ranks and the run's profiled launches; since
    2026-11-29 one adapter refill cycle, sp steps, per launch, one step before) beside the measured step of
    those launches, one row per arm and run, and per (S, sp, run) the
    difference ours-dropin - deepspeed: what switching the import costs or saves (in the engine loop, the
    mechanism's difference). Arms are only set side by side within a run: between runs the machine moves
    identical work by a third. ``kind`` picks the loop, as :func:`benchmarks.records.paired_launches` does."""
    groups: dict = {}
    for rec in records:
        if "error" in rec or rec.get("kind", "step") != kind:
            continue
        profiles = [r["profile"] for r in rec["ranks"] if "profile" in r]
        if profiles:
            key = (setup_key(rec), rec.get("packed_docs", 0), rec["sp"], rec["seq_len"],
                   rec.get("run") or "-")
            groups.setdefault(key, {}).setdefault(rec["name"], []).append((profiles, launch_time(rec)))

    def pooled(launches):
        profiles = [p for ps, _ in launches for p in ps]
        return ({k: statistics.mean(p[k] for p in profiles) for k in profiles[0]},
                statistics.median(t for _, t in launches))

    rows = []
    for (model, packed, sp, s, run), launches in sorted(groups.items()):
        config = [seq_text(s), sp, packed or "-", model or "default", run]
        arms = {name: pooled(launches[name]) for name in sorted(launches)}
        for name, (p, t) in arms.items():
            rows.append([name, *config, f"{p.get('steps', 1):g}", *_profile_cells(p), f"{p['total']:.2f}",
                         f"{t:.2f}"])
        if "ours-dropin" in arms and "deepspeed" in arms:
            (p, t), (ds, ds_t) = arms["ours-dropin"], arms["deepspeed"]
            diff = {k: p[k] - ds[k] for k in p}
            rows.append(["*ours-dropin - deepspeed*", *config, "", *(f"*{c}*" for c in _profile_cells(diff)),
                         f"*{diff['total']:+.2f}*", f"*{t - ds_t:+.2f}*"])
    return md_table(["arm", "S", "sp", "docs", "model", "run", "steps profiled", *(h for h, _ in PROFILE_COLUMNS),
                   "profiled s/step", "measured s/step"], rows)


def format_noise(records: list[dict], kind: str = "step") -> str:
    pairs = paired(records, kind)
    rows = []
    for (name, s, sp, packed, model), values in sorted(pairs.items(), key=lambda kv: (kv[0][4], kv[0][3], kv[0][2],
                                                                                     kv[0][1])):
        if name != NOISE_ARM:
            continue
        rows.append([seq_text(s), sp, packed or "-", model or "default", len(values),
                     ", ".join(f"{t:.3f}" for t, _ in values), f"±{max(abs(t - 1) for t, _ in values):.1%}",
                     ", ".join(f"{m:.3f}" for _, m in values), f"±{max(abs(m - 1) for _, m in values):.1%}"])
    return md_table(["S", "sp", "docs", "model", "reps", "time ratios deepspeed[again] / deepspeed", "time noise",
                   "memory ratios", "memory noise"], rows)


def _profiled(records: list[dict], kind: str) -> bool:
    return any(rec.get("kind", "step") == kind and any("profile" in r for r in rec.get("ranks", ()))
               for rec in records if "error" not in rec)


def format_group(records: list[dict], kind: str = "step") -> str:
    """What ``bench`` prints after each (S, sp): the ratios, the work per step and the profile of those launches
    (where measured)."""
    tables = [format_ratios(records, kind), *spell_notes(records, kind)]
    if _worked(records, kind):
        tables.append(format_work(records, kind))
    if _profiled(records, kind):
        tables.append(format_profile(records, kind))
    return "\n" + "\n\n".join(tables) + "\n"


def format_run(records: list[dict], kind: str = "step") -> str:
    """What ``bench`` prints at the end: noise, ratios, work per step and profile (where measured), every
    measurement."""
    sections = ["## Noise (DeepSpeed against itself)", format_noise(records, kind), "## Ratios",
                format_ratios(records, kind), *spell_notes(records, kind)]
    if _worked(records, kind):
        sections += ["## Work per step (CPU seconds of all ranks)", format_work(records, kind)]
    if _profiled(records, kind):
        sections += ["## Seconds per phase and step (one profiled refill cycle per launch)",
                     format_profile(records, kind)]
    return "\n\n".join(sections + ["## Every measurement", format_summary(summarize(records, kind))])


def format_summary(summary: dict) -> str:
    """Every measured (arm, S, sp, packing, model): medians and the step's split."""
    rows = []
    for (name, s, sp, packed, model), v in sorted(summary.items(), key=lambda kv: (kv[0][4], kv[0][3], kv[0][2],
                                                                                  kv[0][1], kv[0][0])):
        split = " / ".join(f"{x:.2f}" for x in v["phases"])
        rows.append([name, seq_text(s), sp, packed or "-", model or "default", f"{v['time']:.2f}", split,
                     f"{v['peak'] / GIB:.2f}", f"{v['steps_peak'] / GIB:.2f}", f"{v['loss']:.4f}",
                     f"{v['launches']} x {v['steps'] // max(1, v['launches'])}"])
    return md_table(["arm", "S", "sp", "docs", "model", "s/step", "adapter / fwd / bwd / optimizer s", "peak GiB",
                   "step-only peak GiB", "first loss", "launches x steps"], rows)


def format_comm(summary: dict) -> str:
    rows = []
    for (name, s, sp, packed, model), v in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if sp == 1 or packed or "[" in name or name == "deepspeed-alst":
            continue
        calls = ", ".join(f"{n:g} {op}" for op, n in sorted(v["attn_calls"].items()))
        minimum = ulysses_min_bytes(v["model"], s, sp)
        refill = ", ".join(f"{n:g} {op}" for op, n in sorted(v["refill_calls"].items()))
        rows.append([name, seq_text(s), sp, calls, f"{v['bwd_a2a']:g}", f"{v['attn_sent'] / 2**20:.2f}",
                     f"{minimum / 2**20:.2f}", f"{v['attn_sent'] / minimum:.2f}", f"{v['attn_off_rank'] / 2**20:.2f}",
                     f"{v['refill_received'] / 2**10:.1f}", refill])
    return md_table(["impl", "S", "sp", "collectives per attention layer (forward)", "all-to-alls per layer (backward)",
                   "send MiB/layer/rank", "Ulysses min MiB", "vs min", "off-rank MiB/layer/rank",
                   "adapter KiB received/refill/rank", "adapter collectives/refill"], rows)


def planner_rows(summary: dict) -> list[list]:
    """Measured CPU peaks next to :func:`ds_ulysses.planner.cpu_rss`, anchored at an S=64 run.

    The prediction is the measured RSS of DeepSpeed's run of the same model and config at S=64
    (runtime + model states, no activations to speak of) plus the planner's S-dependent terms, so the
    comparison tests the activation model.
    """
    from ds_ulysses.planner import ModelDims, cpu_rss

    rows = []
    for (name, s, sp, packed, model), v in sorted(summary.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        intercept = summary.get(("deepspeed", 64, sp, 0, model))
        if packed or intercept is None or s == 64 or name in (NOISE_ARM, "deepspeed-alst"):
            continue
        m = {**MODEL_DEFAULTS, **v["model"]}
        dims = ModelDims(m["hidden"], m["intermediate"], m["layers"], m["heads"], m["kv_heads"],
                         m["hidden"] // m["heads"], m["vocab"])
        untiled = {"tiled_loss": {"enabled": False}}
        section = v["section"] if name.startswith("ours") and name != "ours-dropin" else untiled
        predicted = intercept["peak"] + cpu_rss(dims, s, sp, section, 0.0) - cpu_rss(dims, 64, sp, section, 0.0)
        rows.append([name, seq_text(s), sp, f"{v['peak'] / GIB:.2f}", f"{predicted / GIB:.2f}",
                     f"{predicted / v['peak'] - 1:+.0%}"])
    return rows


def _plot(summary: dict, key: str, ylabel: str, path: Path, scale: float = 1.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict = {}
    for (name, s, sp, packed, model), v in summary.items():
        if not packed and not model and name in ("deepspeed", "ours-dropin", "ours", "deepspeed-alst") and s >= 1024:
            lines.setdefault((name, sp), []).append((s, v[key] / scale))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (name, sp), points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], STYLES.get(name, "x-"), label=f"{name} sp={sp}")
    return save_seq_plot(fig, ax, ylabel, path)


def _failures(records: list[dict]) -> list[str]:
    failed = {(r["name"], r["seq_len"], r["sp"], r.get("packed_docs", 0)): r["error"].strip().splitlines()[-1]
              for r in records if "error" in r}
    if not failed:
        return []
    rows = [[name, seq_text(s), sp, packed or "-", f"`{err[:200]}`"]
            for (name, s, sp, packed), err in sorted(failed.items())]
    return ["## Launches that failed", md_table(["impl", "S", "sp", "docs/sample", "last error line"], rows)]


def format_provenance(records: list[dict]) -> str:
    """One row per (machine, commit): which kinds of measurement ran there and when. Records written before
    the harness stamped them say "not recorded"."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r.get("machine", "not recorded"), r.get("commit", "not recorded")), []).append(r)
    rows = []
    for (where, code), recs in sorted(groups.items(), key=lambda item: min(r.get("date", "") for r in item[1])):
        kinds = ", ".join(sorted({r.get("kind", "step") for r in recs}))
        rows.append([where, f"`{code}`" if code != "not recorded" else code, kinds, len(recs), _dates(recs)])
    return md_table(["machine", "commit", "kinds", "records", "dates"], rows)


def _dates(records: list[dict]) -> str:
    dates = sorted(r["date"] for r in records if "date" in r)
    return f"{dates[0]} to {dates[-1]}" if dates else "unknown dates"


def _screened_sections(records: list[dict], kind: str = "step") -> list[str]:
    """The noise and ratio tables again over :func:`benchmarks.records.screened` launches alone, where `kind` has
    pairs of them and launches without the figure too (when every launch is screened, they would repeat the tables
    above)."""
    calm_only = screened(records)
    calm_pairs = paired(calm_only, kind)
    if not calm_pairs or calm_pairs == paired(records, kind):
        return []
    return ["Screened launches only (those that recorded the stolen share, since 2026-11-29): the same noise and "
            "ratios from them alone. Each launch above without the figure counts as calm but may have run in a steal "
            "spell; here a configuration's ratios and its noise come from the same screened repetitions.",
            format_noise(calm_only, kind), format_ratios(calm_only, kind)]


def write_report(records: list[dict], out_dir: Path) -> list[Path]:
    """``results.md`` (every table) plus the plots in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    ok = [r for r in records if "error" not in r]
    maxseq = [r for r in ok if r.get("kind") == "maxseq"]
    tiled = [r for r in ok if r.get("kind") == "tiled"]
    sections = [
        "# ds_ulysses vs DeepSpeed ALST (CPU, gloo, ZeRO-3 + CPU offload)",
        f"Generated by `ds-ulysses bench --report` from {len(records)} records ({_dates(records)}).",
        "## Where and at what code the records were measured", format_provenance(records),
        "## Noise: DeepSpeed against itself in the same runs", format_noise(ok),
        *spell_notes(ok),
        "## Ratios arm / DeepSpeed (per repetition, median [min-max]; verdicts only beyond the noise)",
        format_ratios(ok),
        *_screened_sections(ok),
        "## Work per step: CPU seconds of all ranks, arm / DeepSpeed (since 2026-11-29)", format_work(ok),
        "## Seconds per phase and step (the profiled steps of each launch of the first repetition)",
        format_profile(ok),
    ]
    if maxseq:
        sections += ["## Longest sequence in a per-rank RSS budget", format_maxseq(maxseq)]
    if tiled:
        sections += ["## TiledMLP and sequence_tiled_compute vs DeepSpeed's, equal shards", format_tiled(tiled)]
    for kind, title in LOOP_TITLES.items():
        if any(r.get("kind") == kind for r in ok):
            sections += [f"## {title}: noise, ratios arm / DeepSpeed's parallelism_config path",
                         format_noise(ok, kind), *spell_notes(ok, kind),
                         format_ratios(ok, kind), *_screened_sections(ok, kind), format_summary(summarize(ok, kind))]
            if _worked(ok, kind):
                sections += ["Work per step (CPU seconds of all ranks):", format_work(ok, kind)]
            if _profiled(ok, kind):
                sections += ["Seconds per phase and step (the profiled steps of each launch of the first repetition; "
                             "the forward phases hold the loop's whole loss computation):", format_profile(ok, kind)]
    if any(r.get("kind") == "layer" for r in ok):
        sections += ["## The attention layer alone (DeepSpeed's wrapper, its noise arm and ours interleaved per "
                     "iteration)", format_layer(ok)]
    sections += [
        "## Communication per attention layer and per adapter refill", format_comm(summary),
        "## Planner prediction vs measured CPU peak RSS",
        "Prediction = DeepSpeed's measured RSS at S=64 (same model and config: runtime + model states) + the planner's "
        "S-dependent terms (`ds_ulysses.planner.cpu_rss`).",
        md_table(["impl", "S", "sp", "measured peak GiB", "predicted GiB", "error"], planner_rows(summary)),
        "## Every measurement", format_summary(summary),
    ] + _failures(records)
    md = out_dir / "results.md"
    md.write_text("\n\n".join(sections) + "\n")
    paths = [md, _plot(summary, "peak", "peak RSS per rank (GiB)", out_dir / "memory_vs_seq.png", GIB),
             _plot(summary, "time", "step time (s, adapter+forward+backward+step)", out_dir / "time_vs_seq.png")]
    if maxseq:
        paths.append(plot_maxseq(maxseq, out_dir / "max_seq.png"))
    return paths
