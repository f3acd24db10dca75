"""What every table of the harness is made of: the verdict rules, the Markdown table and the plot against S.

A verdict is claimed only beyond the noise (what the same code does to a ratio: ``n = max |ratio - 1|`` of the
noise arm over its repetitions):

- against 1 (ours vs DeepSpeed): ``faster``/``slower`` (``smaller``/``larger``) when ``|r - 1| > n``,
  else ``same within noise``;
- against a target ``t``: ``met`` when ``r + n <= t``, ``missed`` when ``r - n > t``, otherwise
  ``undecided`` (the target lies inside the noise band).
"""

from __future__ import annotations

import statistics
from pathlib import Path

__all__ = ["verdict", "target_verdict", "spread", "seq_text", "md_table", "noise_text", "STYLES", "save_seq_plot"]

STYLES = {"deepspeed": "o--", "ours-dropin": "s-", "ours": "^-", "deepspeed-alst": "d:"}  # plot line per arm


def verdict(ratio: float, noise: float | None, less: str = "faster", more: str = "slower") -> str:
    if noise is None:
        return "no noise measured"
    if abs(ratio - 1) <= noise:
        return "same within noise"
    return less if ratio < 1 else more


def target_verdict(ratio: float, noise: float | None, target: float | None) -> str:
    if target is None:
        return "-"
    if noise is None:
        return f"{'met' if ratio <= target else 'missed'} (noise not measured)"
    if ratio + noise <= target:
        return "met"
    if ratio - noise > target:
        return f"missed by {ratio / target - 1:+.1%}"
    return "undecided (target within noise)"


def spread(values: list[float], digits: int = 2) -> str:
    """The median of `values`, with their range in brackets when there are several."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def seq_text(s: int) -> str:
    """A sequence length as the tables print it: 4096 -> ``4K``, a length that is no multiple of 1K as is."""
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def md_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table of ``rows`` under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def noise_text(n) -> str:
    """A noise band as the tables print it (``±4.0%``), ``-`` where none was measured."""
    return "-" if n is None else f"±{n:.1%}"


def save_seq_plot(fig, ax, ylabel: str, path: Path) -> Path:
    """Finish a plot against S (log2 axis, grid, legend) and write it to ``path``."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence length S (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no lines when every run is shorter than 1K tokens
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
