"""cloudpickle as a parked engine needs it: functions keep the notebook's namespace (data plane).

The one module that reaches into cloudpickle's private hooks (``tests/unit/test_adapters.py``
keeps it so). cloudpickle saves a function defined in a cell with a copy of the globals it
uses, and restores it with a fresh dictionary as its globals: after a resume, such a function
would no longer see the namespace the notebook's next cells change. :class:`Pickler` saves
the functions (and the methods of classes) whose globals are the namespace being parked with
a marker instead, and :func:`loading` makes that marker the namespace being restored, so a
restored function's globals *are* the engine's namespace again. The globals such a function
uses that are saved as variables of their own are left out of its copy (they come back as
those variables, or not at all when dropped).

Example:
    >>> ns = {"__name__": "__main__", "k": 3}
    >>> exec("def f(): return k", ns)
    >>> buf = io.BytesIO()
    >>> with saving(ns, saved={"f", "k"}):
    ...     Pickler(buf, protocol=4).dump(ns["f"])
    >>> new = {"__name__": "__main__", "k": 5}
    >>> with loading(new):
    ...     g = pickle.loads(buf.getvalue())
    >>> g(), g.__globals__ is new
    (5, True)
"""

from __future__ import annotations

import builtins
import io  # noqa: F401 - the module's example uses it
import pickle
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import cloudpickle

__all__ = ["Pickler", "loading", "saving"]

_LOCAL = threading.local()
_IDLE: tuple[Any, frozenset[str], tuple[type, ...]] = (None, frozenset(), ())


class _Namespace:
    """Stands for the engine's namespace in a snapshot: restored as the one being loaded."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_live_namespace, ())


NAMESPACE = _Namespace()


def _live_namespace() -> MutableMapping[str, Any]:
    ns = getattr(_LOCAL, "loading", None)
    if ns is None:
        raise pickle.UnpicklingError("a parked namespace is restored only by hora.engines.park")
    return ns  # type: ignore[no-any-return]


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler; functions of the namespace in :func:`saving` refer to it.

    Objects of the types :func:`saving` refuses are refused outright (a thread, a CUDA
    stream), whatever their own pickling would do.
    """

    def reducer_override(self, obj: Any) -> Any:
        refused = getattr(_LOCAL, "saving", _IDLE)[2]
        if refused and isinstance(obj, refused):
            raise TypeError(f"cannot pickle '{type(obj).__qualname__}' object")
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func: Any) -> Any:
        reduced = super()._dynamic_function_reduce(func)
        ns, saved, _ = getattr(_LOCAL, "saving", _IDLE)
        if ns is None or func.__globals__ is not ns:
            return reduced
        make, (code, _copy, name, defaults, closure), (state, slots), *rest = reduced
        used = {k: v for k, v in slots["__globals__"].items() if k not in saved}
        slots = {**slots, "__globals__": used}
        return (make, (code, NAMESPACE, name, defaults, closure), (state, slots), *rest)


@contextmanager
def saving(
    ns: MutableMapping[str, Any], saved: set[str] | frozenset[str], refused: tuple[type, ...] = ()
) -> Iterator[None]:
    """While pickling: functions whose globals are ``ns`` keep the namespace itself.

    Args:
        ns: the engine's namespace being parked.
        saved: the names saved as variables of their own (left out of each function's copy).
        refused: types never saved (their instances raise ``TypeError``).
    """
    _LOCAL.saving = (ns, frozenset(saved), refused)
    try:
        yield
    finally:
        _LOCAL.saving = _IDLE


@contextmanager
def loading(ns: MutableMapping[str, Any]) -> Iterator[None]:
    """While unpickling: the namespace marker becomes ``ns`` (its ``__builtins__`` kept)."""
    before = ns.get("__builtins__", builtins)
    _LOCAL.loading = ns
    try:
        yield
    finally:
        _LOCAL.loading = None
        ns["__builtins__"] = before  # cloudpickle sets its own module's
