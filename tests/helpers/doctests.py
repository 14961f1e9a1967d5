"""Run the ``>>>`` examples of hora's modules (for tests/unit/test_doctests.py and tests/dist).

``python tests/helpers/doctests.py hora.torch`` runs every ``hora.torch`` module's examples
in a world of one (``hvd.init()`` on gloo, no launcher), in a scratch directory, each
docstring with a fresh namespace of the names the examples assume (:func:`torch_namespace`:
``hvd``, ``torch``, ``F``, a small ``model``, its SGD ``opt``, a batch ``x``/``y``, its
``loss``, ...); it prints each failure and exits 1 if there was one. The other modules'
examples run in the test process itself (:func:`run`).
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
import pkgutil
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules(package: str) -> list[str]:
    """Every module of ``package`` (the package itself included), sorted by name."""
    pkg = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    return sorted(n for n in names if not n.endswith("__main__"))


def run(
    module: ModuleType, namespace: Callable[[], dict[str, Any]] | None = None
) -> tuple[int, int, str]:
    """Run one module's examples.

    Args:
        module: the imported module.
        namespace: makes the names each docstring's examples may use besides the module's
            own (called once per docstring, so that no example sees another's objects).

    Returns:
        ``(attempted, failed, report)``; the report holds doctest's text for each failure.
    """
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module):
        if not test.examples:
            continue
        if namespace is not None:
            test.globs.update(namespace())
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    return result.attempted, result.failed, out.getvalue()


def torch_namespace() -> dict[str, Any]:
    """The names ``hora.torch``'s examples use, made fresh (and ``ckpt.pt`` written)."""
    import hora.torch as hvd
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
    names = {"hvd": hvd, "torch": torch, "F": torch.nn.functional, "model": model, "opt": opt,
             "optimizer": opt, "x": x, "y": y, "loss": loss, "t": torch.ones(4),
             "grad": torch.eye(4), "val_loader": [(x, y)], "loss_sum": 4.0, "correct": 5,
             "n": 8, "dataset": torch.utils.data.TensorDataset(x, y),
             "DataLoader": torch.utils.data.DataLoader}
    elastic = getattr(hvd, "elastic", None)
    if elastic is not None:  # Horovod's elastic examples: a state and a train(state)
        names["state"] = elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
        names["train"] = elastic.run(lambda state: None)
    return names


def _run_torch() -> int:
    import hora.torch as hvd

    os.chdir(tempfile.mkdtemp(prefix="hora-doctests-"))
    hvd.init(backend="gloo")
    attempted = failed = 0
    for name in modules("hora.torch"):
        a, f, report = run(importlib.import_module(name), torch_namespace)
        attempted, failed = attempted + a, failed + f
        sys.stdout.write(report)
        if not hvd.is_initialized():  # an example that shuts down: the next ones need a world
            hvd.init(backend="gloo")
    hvd.shutdown()
    sys.stdout.write(f"doctests: {attempted} examples, {failed} failed\n")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] != ["hora.torch"]:
        sys.exit("usage: doctests.py hora.torch")
    sys.exit(_run_torch())
