"""Elastic state: what survives a reset, saved at ``commit()`` and synced after (data plane).

Horovod's classes and semantics: :class:`State` (commit = save + check for host updates),
:class:`ObjectState` (picklable attributes, synced from rank 0 with ``broadcast_object``) and
:class:`TorchState` (models, optimizers, LR schedulers and :class:`ElasticSampler` through
handlers, other keyword arguments as in ObjectState). ``restore()`` goes back to the last
commit in memory; ``sync()`` makes every rank equal to rank 0, which after a failure is the
lowest surviving rank.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from hora.errors import HostsUpdatedInterrupt
from hora.torch import basics
from hora.torch._objects import broadcast_object
from hora.torch.elastic import _world
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.functions import broadcast_optimizer_state, broadcast_parameters

log = logging.getLogger("hora.torch.elastic")


class State:
    """The base of elastic state: commit, restore, sync and the reset callbacks.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (``hvd.broadcast_object``).
        get_rank: returns this process's rank (``hvd.rank``).

    Example:
        >>> state.register_reset_callbacks([lambda: print("world size", hvd.size())])
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, before the sync."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run :meth:`reset` and the reset callbacks (``hvd.elastic.run`` calls it)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (the point a failure goes back to), then check for hosts.

        Raises:
            HostsUpdatedInterrupt: on every rank alike when the driver changed the world
                (capacity was added or removed); nothing committed is lost.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank when the driver has a new world.

        Outside an elastic ``hora run`` nothing can change the world: a no-op.

        Raises:
            HostsUpdatedInterrupt: when a newer generation is published (the ranks agree
                through a small exchange posted at each check and read at the next one, so
                they all raise it at the same check).
        """
        if _world.check_updates():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Save the current values as the committed ones."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the committed values."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's values rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to a new world (called after each reset, before the callbacks)."""


class ObjectState(State):
    """Elastic state of picklable attributes, given as keyword arguments.

    Args:
        bcast_object: broadcasts a picklable object from rank 0.
        get_rank: returns this process's rank.
        **kwargs: the attributes and their first values.

    Example:
        >>> state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, batch=0)
        >>> state.epoch += 1; state.commit()
    """

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Save the attributes' current values."""
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to their saved values."""
        self._set_attrs()

    def sync(self) -> None:
        """Take rank 0's saved values on every rank."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class StateHandler:
    """Saves, restores and syncs one object of a :class:`TorchState` in its own way."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        """Save the object's current state."""
        raise NotImplementedError

    def restore(self) -> None:
        """Load the saved state into the object."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the object equal to rank 0's."""
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Track another object (an attribute was assigned) and save it."""
        self.value = value
        self.save()


_ATOMS = (int, float, bool, str, bytes, type(None))


def snapshot(obj: Any, into: Any = None) -> Any:
    """A deep copy of a state dict, reusing ``into``'s tensors where they fit.

    Tensors are copied into the previous snapshot's tensor of the same shape, dtype and
    device (no allocation: a commit is a memory copy), else cloned; dicts, lists and tuples
    are rebuilt; numbers and strings are shared; anything else is deep-copied. Much cheaper
    than ``copy.deepcopy`` of a state dict (~90 µs a tensor), which made a commit of the
    digits CNN cost as much as half a training step.

    Example:
        >>> t = torch.ones(2)
        >>> s = snapshot({"w": t})
        >>> _ = t.add_(1)
        >>> s["w"].tolist()
        [1.0, 1.0]
    """
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype
            and into.device == obj.device and obj.layout == torch.strided == into.layout
        ):  # fmt: skip
            return into.copy_(obj.detach())
        return obj.detach().clone()
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        out = {k: snapshot(v, prev.get(k)) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    if type(obj) in (list, tuple):
        fits = isinstance(into, list | tuple) and len(into) == len(obj)
        olds = into if fits else [None] * len(obj)
        return type(obj)(snapshot(v, p) for v, p in zip(obj, olds, strict=True))
    return copy.deepcopy(obj)


class _StateDictHandler(StateHandler):
    """Objects with ``state_dict()`` / ``load_state_dict()``: a copy of it is the commit.

    The copy reuses the last one's tensors (:func:`snapshot`); a restore loads a fresh copy
    of it, so the object never shares a tensor with what is saved.
    """

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.saved = snapshot(value.state_dict())

    def save(self) -> None:
        self.saved = snapshot(self.value.state_dict(), self.saved)

    def restore(self) -> None:
        self.value.load_state_dict(snapshot(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class ModelStateHandler(_StateDictHandler):
    """A ``torch.nn.Module``: parameters and buffers, broadcast tensor by tensor."""

    def sync(self) -> None:
        """Broadcast rank 0's parameters and buffers."""
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """A ``torch.optim.Optimizer`` (or a DistributedOptimizer)."""

    def sync(self) -> None:
        """Broadcast rank 0's optimizer state."""
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    """A learning-rate scheduler."""


class SamplerStateHandler(_StateDictHandler):
    """An :class:`ElasticSampler`: its epoch and progress (``load_state_dict`` re-deals)."""


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """Return the ``(type, handler class)`` pairs TorchState looks values up in, in order."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the handler registry (e.g. to add a handler for your own type first)."""
    global _handler_registry
    _handler_registry = registry


def _handler(value: Any) -> StateHandler | None:
    for kind, cls in _handler_registry:
        if isinstance(value, kind):
            return cls(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a PyTorch training: models, optimizers, samplers, other attributes.

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: an optimizer (optional).
        **kwargs: more attributes: objects with a handler (modules, optimizers, schedulers,
            :class:`ElasticSampler`) are handled by it, the rest must be picklable.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
        >>> train(state)  # decorated with @hvd.elastic.run
    """

    _handlers: dict[str, StateHandler]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {k: h for k, v in kwargs.items() if (h := _handler(v)) is not None}
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        rest = {k: v for k, v in kwargs.items() if k not in handlers}
        super().__init__(bcast_object=broadcast_object, get_rank=_rank, **rest)

    def save(self) -> None:
        """Save every handled object and attribute."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Go back to the last commit."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Make every rank's models, optimizers, samplers and attributes rank 0's."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def _rank() -> int:
    return basics.rank()
