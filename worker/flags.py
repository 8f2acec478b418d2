"""Command-line flags generated from config dataclasses, so that each setting is declared once.

A field `max_num_seqs: int = 256` becomes `--max-num-seqs` (type int, default 256); its help
text comes from the field's metadata (`metadata={"help": ...}`) or from a help mapping, its
allowed values from `metadata={"choices": ...}`, a lower bound from `metadata={"min": ...}`.
Booleans get `--flag / --no-flag`; an optional field also takes `none`; a `dict[str, T]`
field is a repeatable `--flag NAME=VALUE` and a `list[T]` field a repeatable `--flag VALUE`
(named by a `FlagSpec` when the field's own name reads badly as a flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

NONE_WORDS = ("none", "off")


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """Overrides for one field's flag: its name (e.g. `--tenant-weight` for `tenant_weights`),
    metavar, help text."""

    flag: str | None = None
    metavar: str | None = None
    help: str | None = None


@dataclass(frozen=True, slots=True)
class Flag:
    """One generated flag: the field it sets, its option string, default and help text."""

    owner: type
    field: str
    flag: str
    default: Any
    help: str
    kind: str  # "scalar", "bool", "dict" or "list"


def flag_name(field_name: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field_name.replace("_", "-")


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    defaults: Any = None,
    helps: Mapping[str, str] | None = None,
    specs: Mapping[str, FlagSpec] | None = None,
    skip: tuple[str, ...] = (),
) -> list[Flag]:
    """Add one flag per field of dataclass `cls` (defaults from the `defaults` instance, else
    the class's); returns the flags, in field order. Fields in `skip` get none."""
    defaults = defaults if defaults is not None else cls()
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        spec = (specs or {}).get(f.name) or FlagSpec()
        default = getattr(defaults, f.name)
        text = spec.help or f.metadata.get("help") or (helps or {}).get(f.name)
        text = (text or f"{cls.__name__}.{f.name}").replace("%", "%%")
        flags.append(_add(parser, cls, f, hints[f.name], spec, default, text))
    return flags


def dataclass_from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """An instance of `cls` from the parsed flags of its fields (and `extra` fields)."""
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
    }
    return cls(**values, **extra)


def check_bounds(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace) -> None:
    """Exit with a usage error when a field's value is below its `metadata["min"]`."""
    for f in dataclasses.fields(cls):
        low = f.metadata.get("min")
        value = getattr(args, f.name, None)
        if low is not None and value is not None and not value >= low:
            parser.error(f"{flag_name(f.name)}: must be >= {low}, got {value}")


def _add(parser, cls, f, hint, spec: FlagSpec, default: Any, text: str) -> Flag:
    base, optional = _unwrap_optional(hint)
    origin = typing.get_origin(base)
    flag = spec.flag or flag_name(f.name)
    shown = _show_default(default)
    common: dict[str, Any] = {"dest": f.name, "default": default}
    if base is bool:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, help=f"{text} (default: {shown})", **common
        )
        return Flag(cls, f.name, flag, default, text, "bool")
    if origin is dict:
        key_type, value_type = typing.get_args(base)
        parser.add_argument(
            flag,
            action=_DictAction,
            type=_pair_parser(flag, key_type, value_type),
            metavar=spec.metavar or "NAME=VALUE",
            help=f"{text}; repeat the flag for more (default: {shown})",
            **{**common, "default": dict(default or {})},
        )
        return Flag(cls, f.name, flag, default, text, "dict")
    if origin is list or origin is tuple:
        (item_type, *_) = typing.get_args(base)
        parser.add_argument(
            flag,
            action=_ListAction,
            type=_scalar_parser(item_type, False),
            metavar=spec.metavar,
            help=f"{text}; repeat the flag for more (default: {shown})",
            **{**common, "default": list(default or [])},
        )
        return Flag(cls, f.name, flag, default, text, "list")
    choices = f.metadata.get("choices")
    parser.add_argument(
        flag,
        type=_scalar_parser(base, optional),
        choices=choices,
        metavar=spec.metavar or ("{" + ",".join(choices) + "}" if choices else None),
        help=f"{text} (default: {shown})",
        **common,
    )
    return Flag(cls, f.name, flag, default, text, "scalar")


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed); a union of several types is str
    (the field's own parser reads the text, e.g. "512MiB" or "0.5")."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else str), optional
    return hint, False


def _scalar_parser(kind: Any, optional: bool) -> Callable[[str], Any]:
    if kind not in (int, float, str):
        raise TypeError(f"no flag rule for type {kind!r}: give the field a FlagSpec")

    def parse(text: str) -> Any:
        if optional and text.lower() in NONE_WORDS:
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _pair_parser(flag: str, key_type: Any, value_type: Any) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
        try:
            return key_type(name), value_type(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected NAME={value_type.__name__}, got {text!r}"
            ) from None

    parse.__name__ = f"{flag} NAME=VALUE"
    return parse


class _DictAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = dict(getattr(namespace, self.dest) or {})
        key, value = values
        current[key] = value
        setattr(namespace, self.dest, current)


class _ListAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), values])


def _show_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def show_default(value: Any) -> str:
    """A default as the help text and the README table show it."""
    return _show_default(value)
