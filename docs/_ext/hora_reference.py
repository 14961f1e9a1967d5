"""Sphinx extension: generate the reference pages and gather the example notebooks.

When the configuration is read, this writes two MyST pages under ``docs/reference/generated/``
and copies the example notebooks (``notebooks/*.ipynb``) into ``docs/notebooks/examples/``,
where MyST-NB renders them as they are committed, without running them (both folders are
ignored by git; a file is rewritten only when its content changes, so incremental builds stay
incremental):

* ``rest.md``, from the OpenAPI schema of the service's FastAPI app: ``create_app()`` on
  settings whose data directory is a fresh temporary folder. Nothing is started, served or
  fetched: the schema is built in memory.
* ``settings.md``, from :class:`hora_service.settings.Settings`: each field's ``HORA_*``
  variable, type, default, bounds and the meaning its docstring gives it.

``python docs/_ext/hora_reference.py OUT_DIR`` writes the same two pages into ``OUT_DIR``.
"""

from __future__ import annotations

import re
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1]
GENERATED = DOCS / "reference" / "generated"
NOTEBOOKS = DOCS.parent / "notebooks"
EXAMPLES = DOCS / "notebooks" / "examples"


def _text(s: str | None) -> str:
    """Docstring text as one Markdown table-safe line (reST ````x```` becomes ```x```)."""
    s = re.sub(r"``([^`]+)``", r"`\1`", s or "")
    s = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", s)
    return " ".join(s.split()).replace("|", "\\|")


def _paragraphs(s: str | None) -> str:
    """Docstring text as Markdown paragraphs."""
    blocks = re.split(r"\n\s*\n", s or "")
    return "\n\n".join(_text(b) for b in blocks if b.strip())


# --- REST ---------------------------------------------------------------------------------


def openapi_schema() -> dict[str, Any]:
    """The service's OpenAPI schema, built in memory from ``create_app()``."""
    from hora_service.api.app import create_app
    from hora_service.settings import Settings

    with tempfile.TemporaryDirectory(prefix="hora-docs-") as tmp:
        app = create_app(Settings(data_dir=Path(tmp), work_root=Path(tmp)))
        return app.openapi()


def _label(name: str) -> str:
    return "rest-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _type(schema: dict[str, Any]) -> str:
    """A short type for a JSON schema: ``int``, ``list[str]``, ``JobSpec`` (linked), ...."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"{{ref}}`{name} <{_label(name)}>`"
    if "anyOf" in schema:
        return " \\| ".join(_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"dict[str, {_type(schema['additionalProperties'])}]"
    return {"integer": "int", "string": "str", "boolean": "bool", "number": "float",
            "null": "null"}.get(kind, kind)


def _bounds(schema: dict[str, Any]) -> str:
    parts = [f"{word} {schema[key]}" for key, word in
             (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
              ("exclusiveMaximum", "<"), ("minLength", "length ≥"), ("maxLength", "length ≤"),
              ("minItems", "items ≥"), ("maxItems", "items ≤")) if key in schema]
    return ", ".join(parts)


def _endpoint(method: str, path: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", "", f"**{_text(op.get('summary'))}**", ""]
    if op.get("description"):
        lines += [_paragraphs(op["description"]), ""]
    lines += ["Authentication: bearer token." if op.get("security") else
              "Authentication: none.", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | default | meaning |",
                  "|---|---|---|---|---|---|"]
        for p in params:
            schema = p.get("schema", {})
            default = f"`{schema['default']}`" if "default" in schema else ""
            meaning = "; ".join(x for x in (_text(p.get("description")), _bounds(schema)) if x)
            lines.append(f"| `{p['name']}` | {p['in']} | {_type(schema)} | "
                         f"{'yes' if p.get('required') else 'no'} | {default} | {meaning} |")
        lines.append("")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        lines += [f"Body ({media}): {_type(content.get('schema', {}))}", ""]
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for status, resp in sorted(op.get("responses", {}).items()):
        content = resp.get("content", {})
        kinds = ", ".join(_type(c["schema"]) if c.get("schema") else f"`{m}`"
                          for m, c in content.items())
        lines.append(f"| {status} | {_text(resp.get('description'))} | {kinds} |")
    return [*lines, ""]


def _model(name: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"({_label(name)})=", f"### `{name}`", ""]
    if schema.get("description"):
        lines += [_paragraphs(schema["description"]), ""]
    if "enum" in schema:
        lines += ["One of: " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".", ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        lines += ["| field | type | required | default | meaning |", "|---|---|---|---|---|"]
        for field, sub in props.items():
            default = f"`{sub['default']}`" if "default" in sub else ""
            meaning = "; ".join(x for x in (_text(sub.get("description")), _bounds(sub)) if x)
            lines.append(f"| `{field}` | {_type(sub)} | {'yes' if field in required else 'no'}"
                         f" | {default} | {meaning} |")
        lines.append("")
        if schema.get("additionalProperties") is False:
            lines += ["Unknown fields are refused (422).", ""]
    return lines


def rest_page(schema: dict[str, Any]) -> str:
    """The REST reference page (MyST) for an OpenAPI schema."""
    info = schema.get("info", {})
    lines = ["# REST API reference", "",
             f"Generated from the OpenAPI schema of the service ({_text(info.get('title'))} "
             f"{_text(info.get('version'))}); a running service serves the same schema at "
             "`/openapi.json` and pages at `/docs` and `/redoc` (token required). The guide "
             "to the API is [REST API](../service/api.md).", "", "## Endpoints", ""]
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            lines += _endpoint(method, path, op)
    lines += ["## Models", ""]
    for name, sub in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += _model(name, sub)
    return "\n".join(lines).rstrip() + "\n"


# --- settings -----------------------------------------------------------------------------


def _attributes(doc: str) -> dict[str, str]:
    """The ``Attributes:`` section of a Google-style docstring: name -> text."""
    found: dict[str, str] = {}
    section = re.search(r"\n\s*Attributes:\n(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    name = None
    for line in (section.group(1) if section else "").splitlines():
        m = re.match(r"\s{4,8}(\w+): (.*)", line)
        if m and len(line) - len(line.lstrip()) <= 8:
            name = m.group(1)
            found[name] = m.group(2)
        elif name:
            found[name] += " " + line.strip()
    return found


def _annotation(tp: Any) -> str:
    """A readable type: ``int | None``, ``one of `a`, `b```, ``list[str]``, ``Path``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_annotation(a) for a in args)
    if origin is typing.Annotated:
        return _annotation(args[0])
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_annotation(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _value(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, list):
        return f"`{','.join(map(str, v))}`" if v else "none"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, int) and v >= 1 << 16 and v % 1024 == 0:
        mib = v / (1 << 20)
        unit = f"{mib:g} MiB" if v >= 1 << 20 else f"{v // 1024} KiB"
        return f"`{v}` ({unit})"
    return f"`{v}`"


def settings_page() -> str:
    """The settings reference page (MyST) for the service's ``Settings``."""
    from hora_service.settings import Settings

    meaning = _attributes(Settings.__doc__ or "")
    lines = ["# Service settings (`HORA_*`)", "",
             "Generated from `hora_service.settings.Settings`. Each setting is read from the "
             "environment variable `HORA_<NAME>` (the name in capitals); `hora serve` and "
             "`hora up` flags take precedence where they exist. List settings take "
             "comma-separated values.", "",
             "| variable | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        bounds = ", ".join(f"{word} {getattr(m, key)}" for m in field.metadata
                           for key, word in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
                           if getattr(m, key, None) is not None)
        lines.append(f"| `HORA_{name.upper()}` | {_annotation(field.annotation)} | "
                     f"{_value(default)} | {bounds} | {_text(meaning.get(name, ''))} |")
    return "\n".join(lines) + "\n"


# --- Sphinx -------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def copy_notebooks(src: Path = NOTEBOOKS, dest: Path = EXAMPLES) -> list[str]:
    """Copy the example notebooks into the docs tree; drop copies whose original is gone.

    Returns:
        The names of the notebooks now in ``dest``.
    """
    names = sorted(p.name for p in src.glob("*.ipynb"))
    for name in names:
        _write(dest / name, (src / name).read_text(encoding="utf-8"))
    for stale in dest.glob("*.ipynb"):
        if stale.name not in names:
            stale.unlink()
    return names


def generate(out: Path = GENERATED) -> None:
    """Write ``rest.md`` and ``settings.md`` into ``out``."""
    _write(out / "rest.md", rest_page(openapi_schema()))
    _write(out / "settings.md", settings_page())


def _on_config_inited(app: Any, config: Any) -> None:
    generate()
    copy_notebooks()


def setup(app: Any) -> dict[str, Any]:
    """Register the generator with Sphinx."""
    app.connect("config-inited", _on_config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else GENERATED)
