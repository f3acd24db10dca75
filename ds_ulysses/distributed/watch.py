"""A dead or stalled SP peer becomes an error naming the SP group and the step, not a hang.

Every SP collective blocks until all peers of the group take part. When one rank dies, gloo raises
``Connection closed by peer`` on the others at once; when one stalls, they raise after the group's
timeout (``comm_timeout_seconds``, given to ``dist.new_group``). Either way the raw message names
neither the group nor where training was. :class:`GroupWatch` holds what such a message needs (the
group's global ranks, its timeout, how many model forwards it has started) and
:meth:`GroupWatch.collective` re-raises a collective's failure as :class:`SPCommError`. The SP
attention advances :attr:`GroupWatch.step` once per model forward; the mesh owns one watch per SP
group, so the attention, the data adapter, the loss and the engine all report the same step.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch.distributed as dist

from ..patching import ProcessLocal

__all__ = ["GroupWatch", "SPCommError", "is_collective_failure"]

_C10D_DIR = os.path.dirname(dist.__file__)


class SPCommError(RuntimeError):
    """A collective of an SP group failed: a peer died, stalled past the timeout, or diverged."""


def is_collective_failure(err: BaseException) -> bool:
    """True when ``err`` was raised inside torch.distributed (the collective itself), so errors from
    ordinary tensor code around a collective are never mistaken for a dead peer."""
    if isinstance(err, SPCommError) or not isinstance(err, RuntimeError):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_C10D_DIR)


class GroupWatch(ProcessLocal):
    """The identity of one SP group in failure messages, plus its step counter (one per group: copies of a
    model share it)."""

    def __init__(self, ranks, timeout_seconds: float | None = None):
        self.ranks = list(ranks)
        self.timeout_seconds = timeout_seconds
        self.step = 0  # model forwards started under SP (the attention advances it)

    @classmethod
    def of_group(cls, group, timeout_seconds: float | None = None) -> "GroupWatch":
        """A watch for a bare process group (callers that were given a group, not a mesh)."""
        if group is None or not dist.is_initialized():
            ranks = [dist.get_rank() if dist.is_initialized() else 0]
        else:
            ranks = dist.get_process_group_ranks(group)
        return cls(ranks, timeout_seconds)

    def describe(self, what: str, err: BaseException) -> str:
        timeout = (f"comm_timeout_seconds={self.timeout_seconds:g}" if self.timeout_seconds is not None
                   else "the group's timeout")
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (f"SP group ranks {self.ranks}: {what} failed at step {self.step} ({cause}); expected every "
                f"rank of the group in the same collective, but a peer rank died, stalled longer than "
                f"{timeout}, or raised an error of its own; fix: read the log of the rank that failed "
                f"first, or raise comm_timeout_seconds if a step legitimately takes longer")

    def reraise(self, what: str, err: RuntimeError):
        """Raise ``err`` again, as :class:`SPCommError` when a collective failed (call in ``except``).

        The per-layer all-to-alls use this in a plain ``try``/``except``, which costs nothing until
        something fails.
        """
        if is_collective_failure(err):
            raise SPCommError(self.describe(what, err)) from err
        raise err

    @contextlib.contextmanager
    def collective(self, what: str):
        """Re-raise a collective's failure inside the block as :class:`SPCommError`."""
        try:
            yield
        except RuntimeError as err:
            self.reraise(what, err)
