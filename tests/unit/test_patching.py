"""The patch ledger: every change recorded, undone newest first, by tag and owner or all at once."""

import types

from ds_ulysses.patching import ABSENT, Patches


class _Owner:
    def method(self):
        return "class"


def test_attributes_and_items_come_back_exactly_as_they_were():
    ledger, obj, table = Patches(), _Owner(), {"kept": 1, "swapped": 2}
    ledger.set_attr(obj, "method", lambda: "patched", "a", owner=obj)
    ledger.set_attr(obj, "method", lambda: "patched again", "a", owner=obj)  # same spot: first original kept
    ledger.set_item(table, "swapped", 20, "b")
    ledger.set_item(table, "added", 30, "b")
    assert obj.method() == "patched again" and table == {"kept": 1, "swapped": 20, "added": 30}
    assert ledger.original_item(table, "swapped") == 2 and ledger.original_item(table, "added") is ABSENT
    assert ledger.undo() == 3  # one record per patched spot
    assert obj.method() == "class" and "method" not in vars(obj)  # the instance attribute is gone again
    assert table == {"kept": 1, "swapped": 2}
    assert ledger.undo() == 0


def test_undo_by_tag_and_owner_leaves_the_rest():
    ledger, a, b = Patches(), types.SimpleNamespace(x=1), types.SimpleNamespace(x=1)
    calls = []
    ledger.set_attr(a, "x", 2, "feature", owner=a)
    ledger.set_attr(b, "x", 2, "feature", owner=b)
    ledger.on_undo(lambda: calls.append("hook removed"), "other", owner=a)
    assert ledger.has("feature", owner=a) and ledger.has("other")
    assert ledger.undo("feature", owner=a) == 1
    assert (a.x, b.x, calls) == (1, 2, [])
    assert ledger.undo(owner=a) == 1 and calls == ["hook removed"]
    assert ledger.undo() == 1 and b.x == 1


def test_module_attributes_are_restored():
    module = types.ModuleType("fake_deepspeed")
    module.initialize = original = object()
    ledger = Patches()
    ledger.set_attr(module, "initialize", "patched", "install")
    assert ledger.original_attr(module, "initialize") is original
    ledger.undo()
    assert module.initialize is original
