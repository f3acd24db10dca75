"""The one way this package changes objects it does not own, and the one call that undoes it all.

Every change to a user's model (an attention name in its config, a wrapped ``forward``, a hook) or to
a library's tables (Transformers' attention registry, ``deepspeed.initialize``) is made through
:data:`PATCHES`, which records what was there before. :func:`ds_ulysses.uninstall` undoes every
patch, newest first; a feature may also undo only its own (``untile_mlps(model)`` undoes the
``"tiled_mlp"`` patches of that model).

What a patch hangs on a model must survive the model being copied. Some of it reaches process groups,
which can be neither copied nor pickled, and users copy models all the same: TRL builds its reference
model with ``copy.deepcopy``, EMA weights and evaluation snapshots are copies, ``torch.save(model)`` and
multiprocessing pickle. Such objects are :class:`ProcessLocal`: every deep copy of the model refers to
the same one (the copy runs on the same SP groups, as the original does), and a pickle refers to it by a
key into this process's registry. Unpickled in this process the key gives the object back; in a process
that never had it, it gives None, and whatever holds it acts as if SP were not registered (the model
computes as a plain model there).
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

__all__ = ["Patches", "PATCHES", "ProcessLocal", "resolve_process_local"]

ABSENT = object()  # "there was nothing here" (distinct from a stored None)


@dataclass
class _Patch:
    tag: str        # which feature made it ("attention", "tiled_mlp", "sp_loss", ...)
    owner: object   # the model it belongs to, or None for process-wide tables
    kind: str       # "attr", "item" or "call"
    target: object  # the object or table patched (kind "call": the undo function)
    name: object    # attribute name or table key
    before: object  # what was there, or ABSENT

    def undo(self) -> None:
        if self.kind == "call":
            self.target()
        elif self.kind == "item":
            if self.before is ABSENT:
                self.target.pop(self.name, None)
            else:
                self.target[self.name] = self.before
        elif self.before is ABSENT:
            try:
                delattr(self.target, self.name)
            except AttributeError:
                pass
        else:
            setattr(self.target, self.name, self.before)


class Patches:
    """A ledger of reversible changes, undone newest first."""

    def __init__(self) -> None:
        self._done: list[_Patch] = []

    def set_attr(self, obj, name: str, value, tag: str, owner=None) -> None:
        """``obj.name = value``; the first patch of a spot remembers what the object itself held there
        (an instance attribute shadowing a class one is removed again on undo)."""
        if self._find("attr", obj, name) is None:
            own = vars(obj) if hasattr(obj, "__dict__") and not isinstance(obj, type) else None
            before = own.get(name, ABSENT) if own is not None else getattr(obj, name, ABSENT)
            self._done.append(_Patch(tag, owner, "attr", obj, name, before))
        setattr(obj, name, value)

    def set_item(self, table: MutableMapping, name, value, tag: str, owner=None) -> None:
        """``table[name] = value``, remembering the entry it replaced (or that there was none)."""
        if self._find("item", table, name) is None:
            self._done.append(_Patch(tag, owner, "item", table, name, table[name] if name in table else ABSENT))
        table[name] = value

    def on_undo(self, undo: Callable[[], None], tag: str, owner=None) -> None:
        """Record an undo step of another kind (a hook handle's ``remove``, say)."""
        self._done.append(_Patch(tag, owner, "call", undo, None, ABSENT))

    def original_item(self, table: MutableMapping, name):
        """``table[name]`` as it was before this ledger first replaced it (ABSENT if it did not exist)."""
        patch = self._find("item", table, name)
        if patch is not None:
            return patch.before
        return table[name] if name in table else ABSENT

    def original_attr(self, obj, name: str):
        """``obj.name`` as the object held it before this ledger first replaced it."""
        patch = self._find("attr", obj, name)
        return getattr(obj, name, ABSENT) if patch is None else patch.before

    def has(self, tag: str, owner=None) -> bool:
        return any(p.tag == tag and (owner is None or p.owner is owner) for p in self._done)

    def undo(self, tag: str | None = None, owner=None) -> int:
        """Undo the patches with ``tag`` (every tag when None) of ``owner`` (every owner when None),
        newest first; returns how many were undone."""
        keep, undone = [], 0
        for patch in reversed(self._done):
            if (tag is None or patch.tag == tag) and (owner is None or patch.owner is owner):
                patch.undo()
                undone += 1
            else:
                keep.append(patch)
        self._done = keep[::-1]
        return undone

    def _find(self, kind: str, target, name) -> _Patch | None:
        return next((p for p in self._done if p.kind == kind and p.target is target and p.name == name), None)


PATCHES = Patches()
"""The process's ledger: every patch this package makes is recorded here."""


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> ProcessLocal, while it lives


def resolve_process_local(key: str):
    """The :class:`ProcessLocal` a pickle names by ``key``, or None in a process that does not hold it."""
    return _LIVE.get(key)


class ProcessLocal:
    """Mixin: deep copies share this object; pickles refer to it by key (see the module docstring)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        key = self.__dict__.get("_process_key")
        if key is None:
            key = uuid.uuid4().hex
            self.__dict__["_process_key"] = key  # through __dict__: no nn.Module __setattr__ on the way
            _LIVE[key] = self
        return resolve_process_local, (key,)
