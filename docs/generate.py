"""Writes the generated blocks of README.md and docs/ from their one source each.

A block is the text between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` in a page;
NAME picks the function below that renders it:

- the config reference from ``schemas/ulysses.schema.json`` (the schema is the source of truth for every
  field's type, default and meaning, so the docs never restate them by hand);
- the benchmark tables from the records under ``benchmarks/results/`` (``runs.jsonl`` for the CPU harness,
  ``gpu.jsonl`` for the GPU one), through the harness's own pairing and verdict rules
  (:mod:`benchmarks.report`), so a table is what the records say and nothing else.

Run ``python docs/generate.py`` after changing the schema or adding records; ``--check`` writes nothing
and exits 1 naming every stale page (``tests/unit/test_docs.py`` runs it in ``make test``). The
benchmark plots are drawn by ``ds-ulysses bench --report-only --report benchmarks/results`` and only
linked from here: a PNG does not compare byte for byte across matplotlib versions.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

__all__ = ["ROOT", "PAGES", "BLOCKS", "render", "stale_pages", "main"]

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/config.md", "docs/benchmarks.md", "docs/gpu.md", "docs/planner.md", "docs/memory.md")
BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
                   re.DOTALL)
RESULTS = ROOT / "benchmarks" / "results"


def _schema() -> dict:
    return json.loads((ROOT / "schemas" / "ulysses.schema.json").read_text())


def _fields(schema: dict, prefix: str = ""):
    """(dotted name, field schema) for every leaf field, nested objects' fields after their parent."""
    for name, field in schema["properties"].items():
        yield prefix + name, field
        if "properties" in field:
            yield from _fields(field, prefix + name + ".")


def _allowed(field: dict) -> str:
    """What a field accepts, in the schema's own terms."""
    if "enum" in field:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in field["enum"])
    if "anyOf" in field:
        return " or ".join(f"`{json.dumps(a['const'])}`" if "const" in a else _allowed(a) for a in field["anyOf"])
    kinds = field["type"] if isinstance(field["type"], list) else [field["type"]]
    text = " or ".join(kinds)
    if "array" in kinds:
        text = f"[{field['items']['type']}] x {field['minItems']}" + (" or null" if "null" in kinds else "")
    bounds = []
    if "minimum" in field:
        bounds.append(f">= {field['minimum']}")
    if "exclusiveMinimum" in field:
        bounds.append(f"> {field['exclusiveMinimum']}")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def config_table() -> str:
    """Every field of the section: name, what it accepts, default, the schema's description."""
    rows = ["| field | accepts | default | meaning |", "|---|---|---|---|"]
    for name, field in _fields(_schema()):
        default = "" if "properties" in field else f"`{json.dumps(field.get('default'))}`"
        rows.append(f"| `{name}` | {_allowed(field) if 'properties' not in field else 'object'} | {default} | "
                    f"{field.get('description', '').replace('|', '/')} |")
    return "\n".join(rows)


def _first_sentence(text: str) -> str:
    """A description's first sentence: what the field is, the rest staying in docs/config.md."""
    head = re.split(r"(?<!e\.g)(?<!i\.e)(?<=[a-z0-9)])\. ", text, maxsplit=1)[0]
    return head.rstrip(".") + "."


def config_jsonc() -> str:
    """The section with every default, each field under its description's first sentence, what it accepts
    beside it."""
    lines = ["```jsonc", '"ulysses": {']
    props = _schema()["properties"]
    for i, (name, field) in enumerate(props.items()):
        comma = "," if i < len(props) - 1 else ""
        if "properties" in field:
            accepts = "; ".join(f"{k}: {_allowed(v)}" for k, v in field["properties"].items())
        else:
            accepts = _allowed(field)
        accepts = accepts.replace("\\|", "|").replace("`", "")
        summary = textwrap.wrap(_first_sentence(field["description"]), 104, break_on_hyphens=False)
        lines += [f"  // {line}" for line in summary]
        lines.append(f"  {json.dumps(name)}: {json.dumps(field.get('default'))}{comma}".ljust(56) + f" // {accepts}")
    lines += ["}", "```"]
    return "\n".join(lines)


@functools.cache
def _records(name: str) -> list[dict]:
    """The records of one results file, read once per run (the CPU file is a few MB and every table reads it)."""
    path = RESULTS / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cpu_ok() -> list[dict]:
    return [r for r in _records("runs.jsonl") if "error" not in r]


def _k(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def _noise(n) -> str:
    return "-" if n is None else f"±{n:.1%}"


def ratio_table(kind: str) -> str:
    """One row per arm and configuration of a loop (`kind`), against DeepSpeed's arm of the same
    repetitions: seconds and GiB (medians), the ratios' median [min-max], the noise arm's spread, and
    the verdict :mod:`benchmarks.report` draws from them. The noise arm itself is its own column."""
    from benchmarks.arms import NOISE_ARM
    from benchmarks.report import ratio_rows
    from benchmarks.tables import spread
    from ds_ulysses.constants import GIB

    rows = ["| arm | S | sp | DeepSpeed s/step | arm s/step | time ratio [min-max] | noise | vs DeepSpeed "
            "| DeepSpeed GiB | arm GiB | memory ratio [min-max] | noise | vs DeepSpeed | reps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ratio_rows(_cpu_ok(), kind):
        if r["name"] == NOISE_ARM:
            continue
        arm = r["name"] + (f" ({r['model']})" if r["model"] else "") + (f", docs {r['packed']}" if r["packed"] else "")
        rows.append(f"| {arm} | {_k(r['S'])} | {r['sp']} | {r['ds_time']:.2f} | {r['time']:.2f} | "
                    f"**{spread(r['times'])}** | {_noise(r['noise_time'])} | {r['time_verdict']} | "
                    f"{r['ds_peak'] / GIB:.2f} | {r['peak'] / GIB:.2f} | **{spread(r['mems'], 3)}** | "
                    f"{_noise(r['noise_mem'])} | {r['mem_verdict']} | {r['reps']} |")
    return "\n".join(rows)


def maxseq_table() -> str:
    from benchmarks.mode_tables import format_maxseq

    return format_maxseq([r for r in _cpu_ok() if r.get("kind") == "maxseq"])


def tiled_table() -> str:
    from benchmarks.mode_tables import format_tiled

    return format_tiled([r for r in _cpu_ok() if r.get("kind") == "tiled"])


def layer_table() -> str:
    from benchmarks.mode_tables import format_layer

    return format_layer(_cpu_ok())


def comm_table() -> str:
    from benchmarks.records import summarize
    from benchmarks.report import format_comm

    return format_comm(summarize(_cpu_ok()))


def planner_table() -> str:
    """The planner's CPU prediction against each arm's measured peak RSS (:func:`benchmarks.report.planner_rows`)."""
    from benchmarks.records import summarize
    from benchmarks.report import planner_rows

    rows = ["| arm | S | sp | measured peak GiB | predicted GiB | error |", "|---|---|---|---|---|---|"]
    rows += ["| " + " | ".join(str(c) for c in row) + " |" for row in planner_rows(summarize(_cpu_ok()))]
    return "\n".join(rows)


def _rows(kind: str, arm: str, lengths=None, sp: int | None = None) -> list[dict]:
    """`arm`'s ratio rows of a loop at the default model and setting, optionally at given lengths and sp."""
    from benchmarks.report import ratio_rows

    return [r for r in ratio_rows(_cpu_ok(), kind) if r["name"] == arm and not r["model"] and not r["packed"]
            and (lengths is None or r["S"] in lengths) and (sp is None or r["sp"] == sp)]


def _verdicts(rows: list[dict], key: str) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r[key]] = counts.get(r[key], 0) + 1
    if len(counts) == 1:
        return f"{next(iter(counts))} in all {len(rows)}"
    return ", ".join(f"{v} in {n}" for v, n in counts.items())


def _at(kind: str, arm: str, lengths, sp: int = 2) -> tuple[str, str, str, str]:
    """Time and memory ratios of `arm` at `lengths` (joined by ' / '), with their verdicts."""
    rows = sorted(_rows(kind, arm, lengths, sp), key=lambda r: r["S"])
    return (" / ".join(f"{r['time_ratio']:.2f}" for r in rows), " / ".join(f"{r['mem_ratio']:.3f}" for r in rows),
            " / ".join(r["time_verdict"] for r in rows), " / ".join(r["mem_verdict"] for r in rows))


def _span(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}"


def glance_rows() -> list[tuple[str, str, str, str, str]]:
    """(what, against, time, memory, anchor) of the headline figures, each from the records behind its table:
    a ratio is ours / DeepSpeed's (below 1: ours is faster or leaner), its verdict against that
    configuration's noise in brackets."""
    from benchmarks.mode_tables import latest_searches, tiled_ratio
    from ds_ulysses.constants import GIB

    out = []
    t, m, tv, mv = _at("step", "ours", (16384, 32768))
    out.append(("our defaults (the product), 16K / 32K", "DeepSpeed's tutorial recipe", f"{t} ({tv})", f"{m} ({mv})",
                "the-engine-loop"))
    latest = {key[-1]: rec for key, rec in latest_searches([r for r in _cpu_ok() if r.get("kind") == "maxseq"]).items()
              if rec["sp"] == 2}
    ours, ds, alst = latest["ours"]["max_seq"], latest["deepspeed"]["max_seq"], latest["deepspeed-alst"]["max_seq"]
    budget = latest["ours"]["budget"] / GIB
    out.append((f"longest S that trains in {budget:g} GiB per rank",
                f"the tutorial recipe ({_k(ds)}) / every ALST tool ({_k(alst)})", "",
                f"{_k(ours)}: {ours / ds:.2f}x / {ours / alst:.2f}x", "the-longest-sequence-in-a-memory-budget"))
    mech = _rows("step", "ours-dropin")
    out.append(("our drop-in API under DeepSpeed's tutorial code (the mechanism), every length and sp",
                "DeepSpeed's module",
                f"{_span([r['time_ratio'] for r in mech], 2)} ({_verdicts(mech, 'time_verdict')})",
                f"{_span([r['mem_ratio'] for r in mech], 3)} ({_verdicts(mech, 'mem_verdict')})", "the-engine-loop"))
    for kind, what, arms, anchor in (
            ("trainer", "through Transformers' Trainer, 16K: product / mechanism", ("ours", "ours[mechanism]"),
             "through-transformers-trainer"),
            ("accelerate", "in a plain Accelerate loop, 16K: product / drop-in", ("ours", "ours-dropin"),
             "in-a-plain-accelerate-loop"),
            ("trl", "through TRL's SFTTrainer, 16K: ours / drop-in", ("ours", "ours-dropin"),
             "through-trls-sfttrainer")):
        cells = [_at(kind, arm, (16384,)) for arm in arms]
        out.append((what, "its DeepSpeed `parallelism_config` path",
                    " / ".join(c[0] for c in cells) + " (" + " / ".join(c[2] for c in cells) + ")",
                    " / ".join(c[1] for c in cells) + " (" + " / ".join(c[3] for c in cells) + ")", anchor))
    groups: dict[tuple, list[dict]] = {}
    for rec in _cpu_ok():
        if rec.get("kind") == "tiled" and rec.get("result"):
            groups.setdefault((rec["op"], rec["seq_len"]), []).append(rec["result"])
    times = [statistics.median(tiled_ratio(res, "ours", "s") for res in g) for g in groups.values()]
    peaks = [statistics.median(tiled_ratio(res, "ours", "peak") for res in g) for g in groups.values()]
    out.append(("`TiledMLP`, `sequence_tiled_compute`, `TiledFusedLogitsLoss` at equal shards", "DeepSpeed's",
                _span(times, 2), _span(peaks, 3), "tiledmlp-sequence_tiled_compute-and-the-fused-loss"))
    return out


def glance_table(prefix: str, gpu_page: str) -> str:
    """The headline table: :func:`glance_rows` linked to their tables on ``prefix`` (the benchmarks page), and the
    GPU row from :func:`gpu_ratios` linked to ``gpu_page``."""
    rows = ["| what | against | time | peak memory |", "|---|---|---|---|"]
    for what, against, time, memory, anchor in glance_rows():
        rows.append(f"| [{what}]({prefix}#{anchor}) | {against} | {time} | {memory} |")
    gpu = gpu_ratios()
    rows.append(f"| [one H200, Llama-3.2-1B shape, 64K, bf16: ours with every tool]({gpu_page}"
                f"#ours-against-deepspeeds-alst-recipe) | DeepSpeed with every ALST tool | {gpu[0]:.2f} (last step, "
                f"one trial per arm: no verdict) | {gpu[1]:.2f} ({gpu[2]:.2f} / {gpu[3]:.2f} GiB) |")
    return "\n".join(rows)


def _gpu_latest() -> list[dict]:
    records = [r for r in _records("gpu.jsonl") if r.get("ok") and r.get("steps")]
    last = max(r["date"][:10] for r in records)
    return [r for r in records if r["date"][:10] == last]


def gpu_ratios() -> tuple[float, float, float, float]:
    """Ours / DeepSpeed's medians over the latest GPU session: last step's seconds, peak GiB (and both peaks)."""
    latest = _gpu_latest()

    def median(arm, of):
        return statistics.median(of(r) for r in latest if r["impl"] == arm)
    last, peak = (lambda r: sum(r["steps"][-1])), (lambda r: r["peak_gib"])
    ours, ds = median("ours", peak), median("deepspeed", peak)
    return median("ours", last) / median("deepspeed", last), ours / ds, ours, ds


def gpu_table() -> str:
    """The latest GPU session's trials (records of the last day in ``gpu.jsonl``), in the order they ran:
    seconds of each step (forward + backward + optimizer) and the peak CUDA memory."""
    latest = _gpu_latest()
    width = max(len(r["steps"]) for r in latest)
    rows = ["| arm | S | " + " | ".join(f"step {i + 1} s" for i in range(width)) + " | peak GiB |",
            "|---|---|" + "---|" * width + "---|"]
    for r in latest:
        steps = [f"{sum(step):.2f}" for step in r["steps"]] + [""] * (width - len(r["steps"]))
        rows.append(f"| {r['impl']} | {_k(r['seq_len'])} | " + " | ".join(steps) + f" | {r['peak_gib']:.2f} |")
    steady = {arm: statistics.median(sum(r["steps"][-1]) for r in latest if r["impl"] == arm)
              for arm in dict.fromkeys(r["impl"] for r in latest)}
    rows.append("")
    medians = ", ".join(f"{arm} {s:.2f} s" for arm, s in steady.items())
    rows.append(f"Last step, median over the trials: {medians}.")
    return "\n".join(rows)


def longest_table() -> str:
    """``ds-ulysses plan --seq-len max`` for Llama-3.1-8B on the published setups, ours and DeepSpeed's recipe,
    under the 2**31-element tensor limit and past it, beside the published records."""
    from ds_ulysses.constants import GIB
    from ds_ulysses.plan_search import max_seq_len
    from ds_ulysses.planner import KNOWN_MODELS

    dims = KNOWN_MODELS["llama-3.1-8b"]
    setups = [(1, 80, None, "ALST 500K (1 H100)"), (8, 80, 2048, "ALST 3.7M, UPipe 5.24M (8 H100)"),
              (8, 141, None, ""), (32, 80, None, "ALST 15M (32 H100)")]
    rows = ["| GPUs x GiB (host per node) | ours | DeepSpeed's ALST recipe | ours, past 2^31 | DeepSpeed's, past 2^31 "
            "| published |", "|---|---|---|---|---|---|"]
    for gpus, mem, host, published in setups:
        cells = [_m(max_seq_len(dims, gpus, mem * GIB, None if host is None else host * GIB, recipe=recipe)[0])
                 for recipe in ("ours", "deepspeed-alst")] + \
                [_m(max_seq_len(dims, gpus, mem * GIB, None if host is None else host * GIB, recipe=recipe,
                                index_limit=None)[0]) for recipe in ("ours", "deepspeed-alst")]
        where = f"{gpus} x {mem}" + (f" ({host // 1024} TiB)" if host else "")
        rows.append(f"| {where} | " + " | ".join(cells) + f" | {published} |")
    return "\n".join(rows)


def breakdown_table() -> str:
    """The latest breakdown record of each arm and sp (``benchmarks/results/breakdown.jsonl``; the older ones
    stay there as history), in :func:`benchmarks.breakdown.format_breakdown`'s tables."""
    from benchmarks.breakdown_fit import format_breakdown

    latest = {}
    for record in _records("breakdown.jsonl"):
        if record.get("kind") == "breakdown" and "error" not in record:
            latest.pop((record["name"], record["sp"]), None)
            latest[(record["name"], record["sp"])] = record
    return format_breakdown(sorted(latest.values(), key=lambda r: (r["name"], -r["sp"])))


def _m(tokens: int) -> str:
    return f"{tokens / 1e6:.2f}M" if tokens >= 1_000_000 else f"{tokens // 1024}K"


BLOCKS = {
    "readme-longest": longest_table,
    "readme-glance": lambda: glance_table("docs/benchmarks.md", "docs/gpu.md"),
    "bench-glance": lambda: glance_table("", "gpu.md"),
    "config-jsonc": config_jsonc,
    "config-table": config_table,
    "bench-step": lambda: ratio_table("step"),
    "bench-trainer": lambda: ratio_table("trainer"),
    "bench-accelerate": lambda: ratio_table("accelerate"),
    "bench-trl": lambda: ratio_table("trl"),
    "bench-maxseq": maxseq_table,
    "bench-tiled": tiled_table,
    "bench-layer": layer_table,
    "bench-comm": comm_table,
    "bench-planner": planner_table,
    "bench-gpu": gpu_table,
    "memory-breakdown": breakdown_table,
}


def render(text: str) -> str:
    """`text` with every generated block rewritten; an unknown block name is an error naming the known ones."""
    def block(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"generated block {name!r}: expected one of {sorted(BLOCKS)}")
        return f"{m.group(1)}{BLOCKS[name]()}\n{m.group(4)}"
    return BLOCK.sub(block, text)


def stale_pages() -> list[str]:
    """The pages whose generated blocks differ from what :func:`render` writes now."""
    return [page for page in PAGES if render((ROOT / page).read_text()) != (ROOT / page).read_text()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        stale = stale_pages()
        for page in stale:
            print(f"{page}: generated blocks are stale; run `python docs/generate.py`")
        return 1 if stale else 0
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
