"""What a job takes from where it is submitted (data plane): its interpreter and its directory.

``sbatch`` runs a job in the directory it was submitted from, with the submitting shell's
environment. ``hora submit``, :meth:`hora.Client.submit` and ``%dist_submit`` do the same for
what decides which program runs: they put the submitting side's ``PATH``, ``VIRTUAL_ENV``
and ``CONDA_PREFIX`` (:data:`DEFAULT_EXPORT`) into the job's ``env`` and the current
directory into its ``submit_dir`` (the ranks' working directory when no ``working_dir`` is
given and it lies under the service's work root). So ``python`` in a job is the ``python``
of the terminal or notebook it came from. What the job's ``env`` names itself wins, and a
docker job takes no variables (its image has its own interpreter).

``export`` says what is taken, as ``sbatch --export`` does: a comma-separated list of names
(``PATH,VIRTUAL_ENV``), or ``NONE`` for nothing (neither variables nor the directory: the
job starts from the service's environment in its default working directory). Nothing else of
the submitting environment is taken (a token in it stays there); more names can be listed.
The result is plain spec fields: the service validates them once with the rest of the spec.
Light at import (the magics import it when loaded).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hora.errors import SpecError

DEFAULT_EXPORT = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
NONE = "NONE"

Export = str | Sequence[str]


def parse_export(value: Export) -> tuple[str, ...]:
    """The names an ``export`` value takes; ``()`` for ``NONE`` (``--export`` of ``hora submit``).

    Args:
        value: ``NONE``, or names separated by commas (a string) or as a sequence.

    Raises:
        SpecError: field ``export``: a name is not an environment variable's.

    Example:
        >>> parse_export("PATH,VIRTUAL_ENV"), parse_export("NONE"), parse_export(["PATH"])
        (('PATH', 'VIRTUAL_ENV'), (), ('PATH',))
    """
    from hora.spec import ENV_NAME  # pydantic: not at import, %load_ext hora stays light

    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in names if n.strip()]
    if names == [NONE] or not names:
        return ()
    for name in names:
        if not ENV_NAME.match(name):
            raise SpecError("export", f"{name!r} is not NONE or an environment variable's name")
    return tuple(dict.fromkeys(names))


def with_export(
    data: Mapping[str, Any],
    export: Export = DEFAULT_EXPORT,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    interpreter: str | None = None,
) -> dict[str, Any]:
    """``data`` (spec fields) with what the submitting side exports added.

    Args:
        data: the spec's fields as given; its ``env`` wins over what is exported.
        export: what to take (see the module docstring).
        environ: the submitting environment (default: this process's).
        cwd: the submitting directory (default: the current one).
        interpreter: a Python that must come first on the exported ``PATH`` (the client's
            own, so that ``python`` in a job is the notebook's); None: ``PATH`` as it is.

    Returns:
        New spec fields: ``env`` with the exported variables (not for a docker job) and
        ``submit_dir``; ``data`` itself when ``export`` is ``NONE``.

    Example:
        >>> with_export({"command": ["python"]}, "PATH", {"PATH": "/v/bin:/usr/bin"}, Path("/w"))
        {'command': ['python'], 'submit_dir': '/w', 'env': {'PATH': '/v/bin:/usr/bin'}}
    """
    names = parse_export(export)
    if not names:
        return dict(data)
    environ = os.environ if environ is None else environ
    taken = {n: environ[n] for n in names if environ.get(n)}
    if interpreter is not None and taken.get("PATH"):
        taken["PATH"] = _first_on_path(interpreter, taken["PATH"])
    if _is_docker(data):
        taken = {}
    env = {**taken, **dict(data.get("env") or {})}
    out = {**data, "submit_dir": str(cwd or Path.cwd())}
    return {**out, "env": env} if env else out


def client_python() -> str | None:
    """This process's Python when it runs in a virtual or conda environment, else None.

    A notebook's kernel often runs a venv's Python without the venv on ``PATH`` (JupyterLab
    started as ``.venv/bin/hora up``): a job's ``python`` should still be that one.
    """
    in_env = sys.prefix != sys.base_prefix or (Path(sys.prefix) / "conda-meta").is_dir()
    return sys.executable if in_env and sys.executable else None


def _first_on_path(interpreter: str, path: str) -> str:
    """``path`` with the interpreter's directory first (moved there if it was further on)."""
    here = os.path.dirname(interpreter)
    rest = [p for p in path.split(os.pathsep) if p and p != here]
    return os.pathsep.join([here, *rest])


def _is_docker(data: Mapping[str, Any]) -> bool:
    from hora.spec import RuntimeName  # pydantic: not at import (see the module docstring)

    runtime = data.get("runtime")
    return str(runtime) == RuntimeName.docker or (runtime is None and data.get("image") is not None)
