"""The collectives' one vocabulary: operations and reduce ops (data plane).

:class:`Kind` names every operation once: a member *is* the public name (``"allreduce"``, ...)
that errors, the timeline and the stall report show, and carries the code the ranks compare
first in a signature (:func:`hora.torch._handles.signature`). The reduce ops keep Horovod's
values (``hvd.Average == 0`` ... ``hvd.Product == 5``); a reduction's description is
:class:`hora.torch._collective.Collective`.
"""

from __future__ import annotations

from enum import StrEnum

# Horovod's reduce-op values.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

REDUCE_OPS = frozenset((Average, Sum, Min, Max, Product))


class Kind(StrEnum):
    """A collective operation: its public name (the member's value) and its signature code."""

    code: int

    def __new__(cls, name: str, code: int) -> Kind:
        member = str.__new__(cls, name)
        member._value_ = name
        member.code = code
        return member

    ALLREDUCE = "allreduce", 1
    GROUPED_ALLREDUCE = "grouped_allreduce", 1  # one fused allreduce: the same code
    BROADCAST = "broadcast", 2
    ALLGATHER = "allgather", 3
    ALLTOALL = "alltoall", 4
    REDUCESCATTER = "reducescatter", 5
    GROUPED_ALLGATHER = "grouped_allgather", 3  # a group of allgathers, one handle
    GROUPED_REDUCESCATTER = "grouped_reducescatter", 5  # a group of reducescatters
    BARRIER = "barrier", 9
    ADD_PROCESS_SET = "add_process_set", 10
    REMOVE_PROCESS_SET = "remove_process_set", 11
    BROADCAST_OBJECT = "broadcast_object", 12
    ALLGATHER_OBJECT = "allgather_object", 13
    JOIN = "join", 0  # takes part in the rounds; never submitted, so never in a signature
