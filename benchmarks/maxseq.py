"""The longest sequence whose training step fits a per-rank memory budget (``ds-ulysses bench --max-seq``).

For each arm (DeepSpeed's tutorial recipe, DeepSpeed with every ALST tool as ArcticTraining sets
it up, our defaults, any ``ours[variant]``), at the same sp and on the same model, a *probe* is one
fresh launch (:func:`benchmarks.launch.launch`) of ``steps`` whole training steps at length S (3 by
default: a training run's RSS keeps growing after its first step, as the allocator keeps what a step
freed, so one step would flatter every recipe): it fits when every rank's RSS high-water mark (setup
included) stays within the budget. A probe is stopped the moment a rank passes the budget, so a
length that does not fit costs only the time to get there.

The search keeps the longest length that fitted (``lo``) and the shortest that did not (``hi``) and
probes the length a straight line through the two longest fitting probes predicts for the budget
(peak RSS grows linearly with S for a fixed setup; where it does not, e.g. a tile count that jumps,
the bracket still closes), clamped inside the bracket, until ``hi - lo`` is the granularity. It
starts from two short probes, so most of its time goes to the few probes near the answer. Two
guards keep a line that misleads from costing probes: it is followed at most ``EXTRAPOLATE`` times
past the longest fit (where the short probes' peaks are nearly equal, runtime rather than
activations, the line's slope is nearly flat and would aim far past the answer), and where it
aims at or past the shortest failure (the peak grows faster than the line there) the bracket is
halved, while more than two lengths remain in it, instead of walked down one step at a time. With a cap
(``--max-seq-cap``: a length whose step takes too long on this machine to search past it) the bracket starts
closed above at the cap: a search that fits there answers the cap, a lower bound (its record says ``cap``). When
the bracket has closed, ``lo`` is probed a second time (a run's peak RSS moves by a few % between
identical launches, and a length near the budget can fit by luck once): if it fails now, it becomes
``hi`` and the search goes on below it. The result is ``lo``: measured to fit in every probe of it,
at least two, with ``lo + granularity`` measured not to.

Each search is one record (kind ``maxseq``); its table and plot are :func:`benchmarks.mode_tables.format_maxseq`
and :func:`benchmarks.mode_tables.plot_maxseq`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ds_ulysses.constants import GIB

from .arms import arms
from .launch import OverBudget, launch, workdir
from .records import append_record, stamp

__all__ = ["search", "run_maxseq", "START"]

START = 2048  # the first probe; the second is twice as long
EXTRAPOLATE = 4  # the line's guess is capped at this many times the longest length that fitted


def search(probe, budget: int, granularity: int, start: int = START, max_probes: int = 14, log=print,
           cap: int | None = None) -> dict:
    """Longest multiple of ``granularity`` whose ``probe(S) -> peak bytes or None (over budget)`` fits,
    up to ``cap`` (None: no cap; a length past it is never probed).

    Returns ``{"max_seq", "next_failed", "probes": [[S, peak or None], ...]}``; ``max_seq`` fitted in
    every probe of it, two at least unless ``max_probes`` ran out first (0 if nothing fitted);
    ``next_failed`` is None where no length was measured over the budget (a search that reached its cap).
    """
    fits: dict[int, int] = {}
    lo, failed = 0, math.inf
    ceiling = math.inf if cap is None else cap // granularity * granularity + granularity  # first S not probed
    hi = ceiling
    length = min(max(granularity, start // granularity * granularity), hi - granularity)
    probes = []
    while len(probes) < max_probes:
        peak = probe(length)
        probes.append([length, peak])
        log(f"  S={length:>7}: " + (f"peak {peak / GIB:.2f} GiB, fits" if peak is not None else "over budget"))
        if peak is not None:
            fits[length], lo = max(peak, fits.get(length, 0)), max(lo, length)
        else:
            failed = min(failed, length)
            hi = min(hi, length)
            if fits.pop(length, None) is not None:  # it fitted before: a lucky run; the search goes on below it
                lo = max(fits, default=0)
        if hi - lo <= granularity:
            if lo == 0 or sum(s == lo for s, _ in probes) >= 2:
                break
            length = lo  # the answer is probed again before it is believed
            continue
        if len(fits) < 2:  # not enough points for a line yet: double, or halve below the shortest failure
            length = 2 * lo if peak is not None else max(granularity, (lo + hi) // 2 // granularity * granularity)
            if length >= hi:
                length = (lo + hi) // 2 // granularity * granularity if hi == failed else hi - granularity
            if length <= lo:
                break
            continue
        (s1, p1), (s2, p2) = sorted(fits.items())[-2:]
        slope = (p2 - p1) / (s2 - s1)
        guess = min(s2 + (budget - p2) / slope, EXTRAPOLATE * s2) if slope > 0 else 2 * s2
        length = max(int(guess // granularity * granularity), lo + granularity)
        if hi < math.inf:
            length = min(length, hi - granularity)
        if hi == failed and length == hi - granularity and length - lo > 2 * granularity:
            length = (lo + hi) // 2 // granularity * granularity  # the line aims at the failure: bisect instead
    return {"max_seq": lo, "next_failed": failed if failed < math.inf else None, "probes": probes}


def run_maxseq(budget: int, sps, impls, variants: dict, out: Path, model: dict | None = None, granularity: int = 1024,
               timeout: float = 1800.0, steps: int = 3, log=print, cap: int | None = None) -> list[dict]:
    """Search every arm at every sp, each probe ``steps`` training steps, up to ``cap`` (a record that reached
    it carries ``"cap"``); one record per arm appended to ``out``."""
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for sp in sps:
        step = math.lcm(granularity, sp)
        for name, impl, variant, section in arms(impls, variants, noise=False):
            log(f"{name} sp={sp}: searching the longest S within {budget / GIB:.2f} GiB per rank over {steps} steps")

            def probe(seq_len, impl=impl, section=section):
                spec = {"impl": impl, "seq_len": seq_len, "sp": sp, "steps": steps, "warmup": 0, "packed_docs": 0,
                        "model": model or {}, "section": section, "profile": False}
                try:
                    ranks = launch(spec, sp, workdir(), timeout, rss_limit=budget)
                except OverBudget:
                    return None
                peak = max(r["peak"] for r in ranks)
                return peak if peak <= budget else None

            begin = time.monotonic()
            found = search(probe, budget, step, log=log, cap=cap)
            record = {"kind": "maxseq", "name": name, "impl": impl, "variant": variant, "section": section, "sp": sp,
                      "budget": budget, "granularity": step, "probe_steps": steps, "model": model or {}, **found,
                      **({"cap": cap} if cap is not None else {}), "seconds": time.monotonic() - begin, **stamp()}
            append_record(out, record)
            records.append(record)
            log(f"{name} sp={sp}: longest S {found['max_seq']} ({len(found['probes'])} probes, "
                f"{record['seconds']:.0f}s)")
    return records
