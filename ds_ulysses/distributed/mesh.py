"""The rank grid: every process group derives from one ``(dp, sp)`` mesh over the world.

Ranks are laid out as ``arange(world).view(dp, sp)``: an SP group is a row (contiguous ranks, so the
per-layer all-to-all stays inside a node), a DP group is a column (ranks that hold the same sequence
shard of different samples). With a ring (``ring_size > 1``) each row is itself a grid
``view(ring, ulysses)``: the Ulysses all-to-all runs on its innermost, contiguous ranks (the node's fast
links), the ring attention's point-to-point blocks across them; the SP group is still the whole row, so
the data adapter, the loss, DP and ZeRO see the mesh they see without a ring. The :class:`Mesh` object is
passed to whatever needs groups; the mesh is never a module global. Its process groups are shared,
though: torch keeps every group (and its gloo threads) until the world is destroyed, so a process that
sets up SP many times (a notebook, a hyperparameter search, the architecture sweep) would otherwise
gain three groups and about nine threads per setup; every mesh of one world gets the groups the first
mesh of its shape made.

:class:`Mesh` doubles as the Megatron-style ``mpu`` that ``deepspeed.initialize(mpu=...)`` reads:
DeepSpeed takes its batch arithmetic from ``get_data_parallel_world_size`` (dp), its ZeRO
partitioning and gradient reduction from the data-parallel and sequence-data-parallel groups (every
rank of the mesh, since SP peers hold one replica), and its SP-aware averaging from the
sequence-parallel getters. There is no model (tensor or pipeline) parallelism: its group is this rank
alone, as Megatron's is at tensor-parallel size 1, because DeepSpeed sums gradient norms over it and
reads ``None`` as the whole world.
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ..patching import ProcessLocal
from .watch import GroupWatch

__all__ = ["Mesh", "build_mesh", "mesh_shape", "check_mesh_param"]

# world process group -> {(ranks, timeout_seconds): group}; an entry leaves with its world
_GROUPS = weakref.WeakKeyDictionary()


def check_mesh_param(mesh_param) -> tuple[int, int]:
    """``[dp, sp]`` as two positive ints, or a ValueError saying what came in."""
    ok = (isinstance(mesh_param, (list, tuple)) and len(mesh_param) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in mesh_param))
    if not ok:
        raise ValueError(
            f"mesh_param: expected [dp, sp], two integers >= 1 with dp * sp == world size, got "
            f"{mesh_param!r}; fix: e.g. mesh_param=[1, 2] for one SP group of 2 ranks")
    return int(mesh_param[0]), int(mesh_param[1])


def mesh_shape(world_size: int, sp: int | None = None, mesh_param=None) -> tuple[int, int]:
    """The ``(dp, sp)`` grid for ``world_size`` ranks: the one place that checks ``dp * sp == world``.

    ``mesh_param=(dp, sp)`` fixes both; otherwise dp is inferred as ``world_size / sp``. When both
    ``sp`` and ``mesh_param`` are given they must agree. Raises ValueError naming dp, sp, world_size
    and a fix.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"mesh: expected world_size to be a positive integer, got {world_size!r}; fix: pass "
                         "torch.distributed.get_world_size()")
    if mesh_param is not None:
        dp, mesh_sp = check_mesh_param(mesh_param)
        if sp is not None and sp != mesh_sp:
            raise ValueError(f"mesh_param: expected its sp (second entry) to equal sequence_parallel_size={sp}, "
                             f"got {list(mesh_param)}; fix: make them agree or give only one of the two")
        if dp * mesh_sp != world_size:
            fix = (f"set mesh_param to [{world_size // mesh_sp}, {mesh_sp}] or drop it" if world_size % mesh_sp == 0
                   else f"launch {dp * mesh_sp} ranks or change mesh_param")
            raise ValueError(f"mesh_param: expected dp * sp == world_size, got dp={dp} * sp={mesh_sp} = "
                             f"{dp * mesh_sp} but world_size={world_size}; fix: {fix}")
        return dp, mesh_sp
    sp = 1 if sp is None else sp
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sequence_parallel_size: expected an integer >= 1, got {sp!r}; fix: e.g. "
                         "sequence_parallel_size=2")
    if world_size % sp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"sequence_parallel_size: expected sp to divide world_size, got sp={sp} and "
                         f"world_size={world_size} (dp = {world_size}/{sp} = {world_size / sp:g}); fix: launch a "
                         f"multiple of {sp} ranks or set sequence_parallel_size to one of {divisors}")
    return world_size // sp, sp


def _shared_group(ranks: list[int], timeout_seconds: float | None):
    """The group of ``ranks`` with this timeout in the current world, made by the first call for it.

    ``dist.new_group`` must be called by every rank for every group in the same order. Every rank
    builds the same meshes in the same order, so all of them find a group here or all of them make it.
    """
    made = _GROUPS.setdefault(dist.group.WORLD, {})
    key = (tuple(ranks), timeout_seconds)
    if key not in made:
        timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        made[key] = dist.new_group(ranks, timeout=timeout)
    return made[key]


class Mesh(ProcessLocal):
    """Process groups for a ``(dp, sp)`` grid, usable as DeepSpeed's ``mpu``.

    With ``dp == sp == 1`` (or torch.distributed not initialised) every group is ``None`` and every
    collective in the package short-circuits, so the same code runs single-process. ``sp_watch``
    names this rank's SP group and counts its steps in the error a dead or stalled peer causes;
    ``timeout_seconds`` bounds every collective on the mesh's groups.
    """

    def __init__(self, dp: int, sp: int, timeout_seconds: float | None = None, *, ring_size: int = 1):
        world = dist.get_world_size() if dist.is_initialized() else 1
        dp, sp = mesh_shape(world, mesh_param=(dp, sp))
        if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1 or sp % ring_size:
            raise ValueError(f"ring_size: expected a divisor of sp={sp} (sp = Ulysses degree x ring_size), got "
                             f"{ring_size!r}; fix: use one of {[r for r in range(1, sp + 1) if sp % r == 0]}")
        self.dp, self.sp, self.world_size = dp, sp, world
        self.ring_size, self.ulysses_size = ring_size, sp // ring_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.sp_rank = divmod(self.rank, sp)
        self.ring_rank, self.ulysses_rank = divmod(self.sp_rank, self.ulysses_size)
        self.sp_group = self.dp_group = self.own_group = None
        self.ring_group = None  # no ring at ring_size 1
        self.sp_ranks = [self.rank]
        self.dp_ranks = [self.rank]
        self.ring_ranks = [self.rank]
        self.timeout_seconds = timeout_seconds
        self.sp_watch = GroupWatch(self.sp_ranks, timeout_seconds)
        if not dist.is_initialized():
            return
        # groups exist even for a 1-rank world: DeepSpeed broadcasts and reduces over them
        grid = torch.arange(world).view(dp, sp)  # [dp sp]
        for row in grid.tolist():
            group = _shared_group(row, timeout_seconds)
            if self.rank in row:
                self.sp_group, self.sp_ranks = group, row
                self.sp_watch = GroupWatch(row, timeout_seconds)
        for col in grid.t().tolist():
            group = _shared_group(col, timeout_seconds)
            if self.rank in col:
                self.dp_group, self.dp_ranks = group, col
        self.ulysses_group, self.ulysses_ranks = self.sp_group, self.sp_ranks
        if ring_size > 1:
            blocks = grid.view(dp, ring_size, self.ulysses_size)  # [dp ring ulysses]
            for ranks in blocks.reshape(-1, self.ulysses_size).tolist():  # Ulysses: contiguous
                group = _shared_group(ranks, timeout_seconds)
                if self.rank in ranks:
                    self.ulysses_group, self.ulysses_ranks = group, ranks
            for ranks in blocks.transpose(1, 2).reshape(-1, ring_size).tolist():  # ring: stride ulysses
                group = _shared_group(ranks, timeout_seconds)
                if self.rank in ranks:
                    self.ring_group, self.ring_ranks = group, ranks
        for rank in range(world):
            group = _shared_group([rank], timeout_seconds)
            if rank == self.rank:
                self.own_group = group

    def __repr__(self) -> str:
        ring = f", ring={self.ring_size}, ulysses={self.ulysses_size}" if self.ring_size > 1 else ""
        return f"Mesh(dp={self.dp}, sp={self.sp}{ring}, rank={self.rank}, sp_rank={self.sp_rank})"

    # -- the mpu interface DeepSpeed reads ------------------------------------------------------
    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_data_parallel_group(self):
        # DeepSpeed partitions ZeRO-3 parameters (and reduce-scatters their gradients) over this
        # group. SP peers hold the same replica, so for ZeRO it is every rank of the mesh; handing
        # it the pure DP column leaves gradients unreduced across SP peers. The column is
        # ``self.dp_group``; get_data_parallel_world_size stays dp for DeepSpeed's batch arithmetic.
        return self.get_sequence_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        # DeepSpeed's clip_grad_norm_ and get_global_norm_of_tensors (ZeRO stage 0, its bf16 and fp16
        # optimizers) all-reduce the squared gradient norm over this group: None would sum it over the
        # world, every rank holding the whole gradient, and clip with sqrt(world) x the norm
        return self.own_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_group(self):
        return self.own_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self):
        return self.own_group


def build_mesh(sequence_parallel_size: int | None = None, mesh_param=None,
               timeout_seconds: float | None = None, *, ring_size: int = 1) -> Mesh:
    """Mesh from ``mesh_param=(dp, sp)`` or from ``sequence_parallel_size`` with dp inferred."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp, sp = mesh_shape(world, sequence_parallel_size, mesh_param)
    return Mesh(dp, sp, timeout_seconds, ring_size=ring_size)
