"""Dataclass fields that are also command-line flags: the field declares its default and help once, and
the flag is made from it (its name with dashes, its type, its default), as vLLM's `EngineArgs.add_cli_args`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

__all__ = ["add_field_flags", "config_default", "flag_field"]


def flag_field(default: Any, help: str | None = None, **cli: Any) -> Any:
    """A field with its default and, given `help`, the ``pagedrs serve|generate|chat`` flag that sets it
    (``--`` and the name with dashes). `cli`: the flag's extras: `aliases`, `choices`, `parse` (the
    value's parser, e.g. json.loads; for a list or tuple, each item's), `negatable` (a switch with its
    ``--no-`` form), `negative_only` (a switch that is on by default: only its ``--no-`` form, which turns
    it off) and `negative_alias` (one more flag that turns it off)."""
    return field(default=default, metadata={"help": help, **cli})


def config_default(config: type, name: str) -> Any:
    """The default that `config`'s field `name` declares (EngineArgs takes its defaults from there)."""
    return next(f.default for f in fields(config) if f.name == name)


def _add_flag(group: Any, f: dataclasses.Field, hint: Any) -> None:
    """One field's flag: a switch for a bool (with its --no- form when negatable; only that form when
    negative_only), `nargs="+"` for a list or tuple, else one value parsed by the field's type (or its
    `parse`)."""
    meta = f.metadata
    kinds = [t for t in (get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,))]
    kind = next(t for t in kinds if t is not type(None))
    kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
    flag = "--" + f.name.replace("_", "-")
    if kind is bool and meta.get("negative_only"):
        group.add_argument("--no-" + flag[2:], action="store_false", **kw)
        return
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction if meta.get("negatable") else "store_true"
    elif get_origin(kind) in (list, tuple):
        kw.update(type=meta.get("parse", get_args(kind)[0]), nargs="+")
    else:
        kw.update(type=meta.get("parse", kind), choices=meta.get("choices"))
    group.add_argument(*meta.get("aliases", ()), flag, **kw)
    if "negative_alias" in meta:
        group.add_argument(
            meta["negative_alias"],
            dest=f.name,
            action="store_false",
            help=f"same as --no-{f.name.replace('_', '-')}",
        )


def add_field_flags(group: Any, cls: type) -> None:
    """A flag for each field of the dataclass `cls` that has help, in the fields' order."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("help") is not None:
            _add_flag(group, f, hints[f.name])
