"""A reduction's description, passed whole from the public functions down (data plane).

:class:`Collective` is what a caller asked a reduction (allreduce, reducescatter and their
grouped forms) to do -- reduce op, name, the deprecated ``average``, scale factors, process
set. The public functions build it once from Horovod's keyword arguments; the ops layer
(:mod:`hora.torch._ops`, :mod:`~hora.torch._gather`, :mod:`~hora.torch._grouped`) and the
autograd Functions (:mod:`hora.torch._autograd`, which keep it for the backward) take it
whole. The operations' names and the reduce ops are in :mod:`hora.torch._kinds`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hora.errors import UnsupportedError
from hora.torch._kinds import REDUCE_OPS, Adasum, Average, Sum
from hora.torch._process_sets import ProcessSet


@dataclass(frozen=True, slots=True, init=False)
class Collective:
    """A reduction as the caller described it (Horovod's keyword arguments, unchecked).

    Attributes:
        op: Average, Sum, Min, Max or Product; None for the default (see :meth:`reduce_op`).
        average: Horovod's deprecated flag (False means Sum).
        name: the collective's name; None for an automatic one.
        prescale: multiply before reducing.
        postscale: multiply after reducing (and averaging).
        process_set: the process set it runs on.
    """

    op: int | None
    average: bool | None
    name: str | None
    prescale: float
    postscale: float
    process_set: ProcessSet

    def __init__(
        self,
        op: int | None,
        average: bool | None,
        name: str | None,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> None:
        # built once per collective call: the slots' own setters cost about half of the
        # object.__setattr__ calls a frozen dataclass's generated __init__ makes
        _SET_OP(self, op)
        _SET_AVERAGE(self, average)
        _SET_NAME(self, name)
        _SET_PRESCALE(self, prescale)
        _SET_POSTSCALE(self, postscale)
        _SET_PROCESS_SET(self, process_set)

    def reduce_op(self) -> int:
        """The reduce op to run: ``op``, else Sum when ``average`` is False, else Average.

        Raises:
            ValueError: both ``op`` and ``average`` given, or an unknown op.
            UnsupportedError: op=Adasum.
        """
        op, average = self.op, self.average
        if op is not None and average is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        if op is None:
            op = Sum if average is False else Average
        if op == Adasum:
            raise UnsupportedError("op=Adasum is not supported by hora.torch; use Average or Sum")
        if op not in REDUCE_OPS:
            raise ValueError(f"op={op!r} is not one of Average, Sum, Min, Max, Product")
        return op

    def unnamed(self) -> Collective:
        """The same reduction with an automatic name (the backward of a named forward)."""
        return replace(self, name=None)


_SET_OP, _SET_AVERAGE, _SET_NAME, _SET_PRESCALE, _SET_POSTSCALE, _SET_PROCESS_SET = (
    Collective.__dict__[f.name].__set__ for f in fields(Collective)
)
