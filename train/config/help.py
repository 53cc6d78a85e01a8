"""``--help`` text from a schema: every dotted key, its default and the comment beside its field."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Literal

import yaml

from longsft.train.config.schema import RunConfig


def config_help(cls: type, usage: str) -> str:
    """``usage`` plus every key of dataclass ``cls`` with its default and the comment beside it.

    Nested dataclasses are listed by their dotted keys (``optim.lr``), lists of them by index
    (``stages.N.seq_len``)."""
    return "usage:\n" + usage.rstrip("\n") + "\n\n" + keys_help(cls)


def keys_help(cls: type) -> str:
    """Every key of dataclass ``cls`` (dotted), its default and its comment, one per line."""
    rows = _key_rows(cls, "")
    width = max(len(k) for k, _ in rows) + 2
    return "keys (key=default):\n" + "\n".join(f"  {k:<{width}}{n}".rstrip() for k, n in rows)


def _key_rows(cls: type, prefix: str) -> list[tuple[str, str]]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    notes, above = {}, []  # a field's note: the comment beside it, else the comment lines just above it
    for line in source.splitlines()[1:]:
        text = line.strip()
        m = re.match(r"(\w+):[^#]*(?:#\s*(.*))?$", text)
        if text.startswith("#"):
            above.append(text.lstrip("# "))
        elif m and not text.startswith(("def ", "return ")):
            notes[m.group(1)] = m.group(2) or " ".join(above)
            above = []
        else:
            above = []

    def shown(v) -> str:  # as it would be typed back: YAML flow style (tuples as lists)
        v = list(v) if isinstance(v, tuple) else v
        if v == "":
            return ""
        return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()

    hints, rows = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            rows += _key_rows(tp, f"{prefix}{f.name}.")
            continue
        if inner is not None and dataclasses.is_dataclass(inner):
            rows += _key_rows(inner, f"{prefix}{f.name}.N.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
        note = "; ".join(x for x in ("|".join(choices), notes.get(f.name, "")) if x)
        rows.append((f"{prefix}{f.name}={shown(default)}", note))
    return rows


RUN_KEYS = """A recipe (recipes/NAME.yaml, default: tiny) sets most keys; key=value overrides any of them, lists by
index (stages.1.seq_len=8192) or whole (stages=[{name: a, bucket: 16k}]). The defaults below are the
schema's; `longsft config recipe=NAME` prints a recipe's resolved values."""


def run_help(cmd: str, extra: str = "") -> str:
    """The ``--help`` of a command that takes a run's ``recipe=NAME key=value ...``."""
    return config_help(RunConfig, f"    longsft {cmd} recipe=NAME [key=value ...]{extra}\n\n{RUN_KEYS}")


def run_keys_epilog() -> str:
    """The run keys, for the ``--help`` of a command that also takes ``--flags`` (plan, submit)."""
    return f"and a run: recipe=NAME [key=value ...]. {RUN_KEYS}\n\n{keys_help(RunConfig)}"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)
