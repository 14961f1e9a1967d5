"""The collectives' vocabulary (hora.torch._kinds) and a reduction's description (_collective).

No world is needed: these are the pure parts every collective goes through.
"""

from __future__ import annotations

import hora.torch as hvd
import pytest
from hora.errors import CollectiveTimeout, UnsupportedError
from hora.torch._collective import Collective
from hora.torch._kinds import Kind


def _coll(op: int | None = None, average: bool | None = None) -> Collective:
    return Collective(op, average, "t", 1.0, 1.0, hvd.global_process_set)


@pytest.mark.parametrize(
    ("op", "average", "expected"),
    [
        (None, None, hvd.Average),
        (None, True, hvd.Average),
        (None, False, hvd.Sum),
        (hvd.Min, None, hvd.Min),
        (hvd.Product, None, hvd.Product),
    ],
)
def test_reduce_op_defaults_as_horovod(op: int | None, average: bool | None, expected: int) -> None:
    assert _coll(op, average).reduce_op() == expected


@pytest.mark.parametrize(
    ("op", "average", "error", "says"),
    [
        (hvd.Sum, True, ValueError, "either op= or the deprecated average="),
        (hvd.Adasum, None, UnsupportedError, "Adasum"),
        (7, None, ValueError, "op=7 is not one of"),
        ("sum", None, ValueError, "op='sum' is not one of"),
    ],
)
def test_reduce_op_refuses(op: object, average: bool | None, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        _coll(op, average).reduce_op()  # type: ignore[arg-type]


def test_a_collective_is_frozen_and_unnamed_keeps_the_rest() -> None:
    coll = Collective(hvd.Sum, None, "grad", 0.5, 2.0, hvd.global_process_set)
    with pytest.raises(AttributeError):
        coll.name = "other"  # type: ignore[misc]
    assert coll.unnamed() == Collective(hvd.Sum, None, None, 0.5, 2.0, hvd.global_process_set)


def test_horovod_reduce_op_values() -> None:
    values = (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product)
    assert values == (0, 1, 2, 3, 4, 5)
    assert all(type(v) is int for v in values)


def test_each_kind_is_its_public_name() -> None:
    assert Kind.ALLREDUCE == "allreduce" and f"{Kind.ALLREDUCE}" == "allreduce"
    by_name: dict[str, int] = {Kind.GROUPED_ALLREDUCE: 1}
    assert by_name["grouped_allreduce"] == 1
    # the grouped forms share their member operation's code; every other code is one op's
    codes = {k.code for k in Kind if not k.startswith("grouped_")}
    assert len(codes) == len([k for k in Kind if not k.startswith("grouped_")])
    assert Kind.GROUPED_ALLREDUCE.code == Kind.ALLREDUCE.code


def test_an_error_keeps_a_plain_op_name() -> None:
    e = CollectiveTimeout(Kind.ALLREDUCE, [1], 5.0, name="g")
    assert type(e.op) is str and e.op == "allreduce"
