"""What :mod:`benchmarks.gpu.longest` prints after its trials at fixed lengths: each arm's trial (or, over
repetitions, its median and range), each arm against DeepSpeed's recipe with a verdict where the noise
arm ran, and, with ``--profile``, the operators where each arm's profiled step differs most.

Imported by the driver only: a trial's process never loads it (nor, through it, ds_ulysses), so
DeepSpeed's arm runs without our package imported.
"""

from __future__ import annotations

import statistics

from benchmarks.arms import NOISE_ARM
from benchmarks.gpu.kernels import differences
from benchmarks.tables import spread, verdict

__all__ = ["ratio_lines", "profile_lines"]


def _cell(arm: str, t: dict) -> str:
    if not t["ok"]:
        return f"{arm} failed ({t['why'][:60]})"
    first, done = t.get("allocators_per_step", [{}])[0], []
    if first.get("pinned_allocs"):
        done.append(f"{first['pinned_alloc_s']:.2f} s creating {first['pinned_allocs']} pinned host blocks")
    for key, what in (("cuda_mallocs", "cudaMalloc"), ("alloc_retries", "allocator retries")):
        if first.get(key):
            done.append(f"{first[key]} {what}")
    steps = "steps " + ", ".join(f"{sum(step):.2f}" for step in t["steps"]) + (": " + ", ".join(done) if done else "")
    return f"{arm} {t['seconds']:.2f} s/step ({steps}), {t['peak_gib']:.1f} GiB"


def _repeated_cell(arm: str, trials: list[dict]) -> str:
    done = [t for t in trials if t["ok"]]
    failed = len(trials) - len(done)
    cell = (f"{arm} {spread([t['seconds'] for t in done])} s/step, {spread([t['peak_gib'] for t in done], 1)} GiB "
            f"over {len(done)} trials" if done else f"{arm} no trial trained")
    why = next((t["why"] for t in trials if not t["ok"]), "")
    return cell + (f" ({failed} failed: {why[:60]})" if failed else "")


def _paired(trials: dict, arm: str) -> list[tuple[float, float]]:
    """(time ratio, memory ratio) of `arm` to ``deepspeed`` per repetition where both trained."""
    return [(a["seconds"] / d["seconds"], a["peak_gib"] / d["peak_gib"])
            for a, d in zip(trials.get(arm, []), trials.get("deepspeed", [])) if a["ok"] and d["ok"]]


def _against_deepspeed(arm: str, pairs: list, noise: tuple | None) -> str:
    parts = []
    for i, (what, less, more) in enumerate((("time", "faster", "slower"), ("memory", "less", "more"))):
        values = [pair[i] for pair in pairs]
        text = f"{what} {spread(values)}"
        if noise is not None:
            text += f" ({verdict(statistics.median(values), noise[i], less, more)}, noise {noise[i]:.1%})"
        parts.append(text)
    return f"{arm} / deepspeed: " + ", ".join(parts)


def ratio_lines(by_len: dict) -> list[str]:
    """Per length: each arm's trial (one repetition) or median [range] (several), then each arm against
    ``deepspeed``, paired by repetition, with a verdict where the noise arm ran: max |again / deepspeed - 1|
    over the repetitions, as the CPU benchmark's (:func:`benchmarks.tables.verdict`)."""
    lines = []
    for s, trials in by_len.items():
        once = all(len(t) == 1 for t in trials.values())
        cells = [_cell(arm, t[0]) if once else _repeated_cell(arm, t) for arm, t in trials.items()]
        same = _paired(trials, NOISE_ARM)
        noise = tuple(max(abs(pair[i] - 1) for pair in same) for i in range(2)) if same else None
        for arm in trials:
            pairs = _paired(trials, arm)
            if arm not in ("deepspeed", NOISE_ARM) and pairs:
                cells.append(_against_deepspeed(arm, pairs, noise))
        lines.append(f"  S={s:>9,}: " + "; ".join(cells))
    return lines


def profile_lines(by_len: dict) -> list[str]:
    """Per length and arm with a profile, where its profiled step spent device time against ``deepspeed``'s
    (their last repetition's), phase by phase: the totals, then the operators that differ most."""
    lines = []
    for s, trials in by_len.items():
        theirs = next((t for t in reversed(trials.get("deepspeed", [])) if t.get("profile")), None)
        for arm, runs in trials.items():
            ours = next((t for t in reversed(runs) if t.get("profile")), None)
            if theirs is None or ours is None or arm in ("deepspeed", NOISE_ARM):
                continue
            lines.append(f"  S={s:,}, {arm} against deepspeed, self time per operator in ms (profiled step):")
            for phase, (mine, other, rows) in differences(ours["profile"], theirs["profile"]).items():
                lines.append(f"    {phase}: {mine:.1f} against {other:.1f} ({mine - other:+.1f})")
                lines += [f"      {name}: {a:.1f} against {b:.1f} ({a - b:+.1f})" for name, a, b in rows]
    return lines
