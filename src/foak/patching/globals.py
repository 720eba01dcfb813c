"""Ref-counted, restorable installs of shared objects: a module global (transformers' ``apply_rotary_pos_emb``,
TRL's chunked log-prob function) or an entry of a registry (transformers' attention interfaces).

Several patched models share one install: the first acquires it, the last release undoes it. The undo puts the
previous object back only while what foak installed is still there: a library that installed its own object
over foak's later keeps it (foak's object, which it may call, then only passes calls on, because no patched
model is active)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

_lock = threading.Lock()
_installs: dict[object, list] = {}  # key -> [undo, count]


def acquire(key: object, install: Callable[[], Callable[[], None]]) -> None:
    """Count one user of the install ``key``; the first runs ``install()``, which returns its undo."""
    with _lock:
        entry = _installs.get(key)
        if entry is None:
            entry = _installs[key] = [install(), 0]
        entry[1] += 1


def release(key: object) -> None:
    """Drop one user of ``key``; the last one runs the undo."""
    with _lock:
        entry = _installs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _installs[key]
            entry[0]()


def users(key: object) -> int:
    with _lock:
        entry = _installs.get(key)
        return 0 if entry is None else entry[1]


def acquire_for(owner, state, key: object, install: Callable[[], Callable[[], None]]) -> None:
    """:func:`acquire` on behalf of ``owner`` (a module): released by ``foak.restore`` (through ``state``), or
    when the owner is garbage-collected without one."""
    acquire(key, install)
    state.on_restore(weakref.finalize(owner, release, key))


def replace_attribute(target: object, name: str, value: object) -> Callable[[], None]:
    """Set ``target.<name> = value``; returns the undo, which puts the previous object back only while
    ``target.<name>`` is still ``value``."""
    previous = getattr(target, name)
    setattr(target, name, value)

    def undo():
        if getattr(target, name, None) is value:
            setattr(target, name, previous)

    return undo


def register_in(interface, name: str, function: Callable) -> Callable[[], None]:
    """Register ``function`` as ``name`` in one of transformers' global interfaces (AttentionInterface,
    ExpertsInterface...); returns the undo, which removes the entry only while it is still ``function``."""
    interface.register(name, function)

    def undo():
        mapping = type(interface)._global_mapping
        if mapping.get(name) is function:
            del mapping[name]

    return undo
