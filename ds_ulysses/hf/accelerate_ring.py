"""Accelerate's SP path with the section's ring: ``Accelerator.prepare`` and the Trainer's loader wrapping.

Accelerate sets SP up from inside ``Accelerator._prepare_deepspeed`` with DeepSpeed's two calls:
``UlyssesSPAttentionHF.register_with_transformers(...)`` and ``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group,
sp_world_size, device)``, neither of which carries a ring; Transformers' Trainer wraps its train loader
afterwards through ``Accelerator.deepspeed_ulysses_dl_adapter``. After :func:`ds_ulysses.install`, when the
DeepSpeed config's section has ``ring_size`` other than 1:

- the registration Accelerate makes runs inside :func:`~ds_ulysses.hf.register.section_ring`, so the mesh it
  returns (and Accelerate passes to ``deepspeed.initialize`` as ``mpu``) is the section's ``(ring, ulysses)``
  grid, the one :func:`ds_ulysses.initialize` then checks and prepares the model on;
- every adapter Accelerate builds for that engine lays samples out head-tail for the engine mesh's ring
  (:meth:`~ds_ulysses.sp.data.UlyssesSPDataLoaderAdapter.with_ring`), as :func:`ds_ulysses.initialize`'s own
  loader does.

What the ring does not serve is refused by name on every rank: another core when the Accelerator is built
(:func:`~ds_ulysses.hf.trainer.reconcile`), packed documents and left padding at the first forward
(:mod:`ds_ulysses.sp.ring`).
"""

from __future__ import annotations

from ..config import parse_ds_config
from ..distributed.mesh import Mesh
from ..sp.data import UlyssesSPDataLoaderAdapter
from .register import section_ring

__all__ = ["prepare_deepspeed", "ulysses_dl_adapter"]


def _section_ring_size(accelerator):
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return 1
    _, section = parse_ds_config(plugin.deepspeed_config)
    return 1 if section is None else section.ring_size


def _engine_ring(engine) -> int:
    mesh = getattr(engine, "mpu", None)
    return mesh.ring_size if isinstance(mesh, Mesh) else 1


def _with_ring(item, ring: int):
    return item.with_ring(ring) if isinstance(item, UlyssesSPDataLoaderAdapter) and item.ring_size != ring else item


def prepare_deepspeed(original, accelerator, *args):
    """``Accelerator._prepare_deepspeed`` (``original``) with the section's ring."""
    ring_size = _section_ring_size(accelerator)
    if ring_size == 1:
        return original(accelerator, *args)
    with section_ring(ring_size):
        result = original(accelerator, *args)
    engine = next((item for item in result if _engine_ring(item) > 1), None)
    if engine is None:
        return result
    return tuple(_with_ring(item, _engine_ring(engine)) for item in result)


def ulysses_dl_adapter(original, accelerator, dl, model):
    """``Accelerator.deepspeed_ulysses_dl_adapter`` (``original``): the Trainer's train loader, wrapped after
    ``prepare(model)``, laid out for the ring of ``model``'s engine mesh."""
    return _with_ring(original(accelerator, dl, model), _engine_ring(model))
