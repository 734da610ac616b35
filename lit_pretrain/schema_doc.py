"""The configuration reference, docs/configuration.md, generated from the typed schema: every key with its type,
default, range and the docstring written under its declaration. `python -m lit_pretrain.schema_doc` (`make docs`)
writes it; tests/test_docs.py checks the committed file equals `reference()`, so it cannot drift from the schema.

Pure: reads the schema's dataclasses and their source; imports neither torch nor Lightning."""

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path

from lit_pretrain.schema import Config

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m lit_pretrain.schema_doc"


def field_docs(cls: type) -> dict:
    """{field name: (annotation as written, docstring)} from the class's source: the string under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = inspect.cleandoc(nxt.value.value)
            out[node.target.id] = (ast.unparse(node.annotation), doc)
    return out


def _nested(tp) -> tuple:
    """(dataclass, suffix) when a field holds a section ('') or a list of them ('[]'), else (None, None)."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return _nested(args[0])
    if typing.get_origin(tp) in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    return None, None


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`" if value else "`''`"


def _range(meta) -> str:
    parts = []
    if "choices" in meta:
        parts.append("one of " + ", ".join("null" if c is None else str(c) for c in meta["choices"]))
    for op, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if op in meta:
            parts.append(f"{word} {meta[op]}")
    if "rule" in meta:
        parts.append(meta["rule"])
    return "; ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(cls: type, prefix: str, out: list) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows, subs = [], []
    for f in dataclasses.fields(cls):
        annotation, doc = docs.get(f.name, (str(f.type), ""))
        sub, suffix = _nested(hints[f.name])
        key = f"{prefix}{f.name}"
        if sub is not None:
            subs.append((sub, f"{key}{suffix}.", doc))
        rng = _range(f.metadata)
        rows.append(f"| `{key}` | `{_cell(annotation)}` | {_cell(_default(f))} | "
                    f"{_cell(doc)}{' Range: ' + _cell(rng) + '.' if rng else ''} |")
    out += [f"## `{prefix.rstrip('.') or 'top level'}`", ""]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):  # dataclass's generated signature: no doc
        out += [" ".join(inspect.cleandoc(cls.__doc__).split()), ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for sub, sub_prefix, _ in subs:
        _section(sub, sub_prefix, out)


def reference() -> str:
    """The whole of docs/configuration.md, from the schema alone."""
    out = ["# Configuration reference", "",
           f"Generated from the config schema by `{REGENERATE}` (`make docs`); do not edit by hand. Set any key in "
           "a run file or as `key=value` on the command line; a key in a list of sections is written here with `[]` "
           "(`data.sources[].weight`: the `weight` of each entry of `data.sources`).", ""]
    for f in dataclasses.fields(Config):
        sub, suffix = _nested(typing.get_type_hints(Config)[f.name])
        _section(sub, f"{f.name}{suffix}.", out)
    return "\n".join(out).rstrip("\n") + "\n"


def keys() -> set:
    """Every dotted key the reference lists (list sections without their `[]`), for the docs test."""
    found = set()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            found.add(prefix + f.name)
            sub, _ = _nested(hints[f.name])
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")

    walk(Config, "")
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(reference())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
