"""Command-line flags from the settings' own declarations (:func:`raystudy.settings.setting`): one flag per
setting with its type, choices, help and default (:func:`add_flags`), and the dataclass built back from the
parsed flags (:func:`from_args`). A command adds the groups it takes; nothing here lists a setting."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from typing import Any

from raystudy.settings import CHECKS, base_type, default_of


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def checked(kind: type, check: str | None = None) -> Callable[[str], Any]:
    """An argparse ``type``: the text as ``kind`` (``int``, or ``float``: finite, never NaN or infinite) that
    holds the settings check ``check`` (:data:`raystudy.settings.CHECKS`), else an argparse error saying
    what the value must be (one line, exit status 2)."""
    holds, why = CHECKS[check] if check else ((lambda v: True), "")
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        if not holds(value):  # a given value is never None: the check's "None or" does not apply
            raise argparse.ArgumentTypeError(f"{text!r}: {why.replace('None or ', '')}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _fmt_default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser, cls: type, names: Iterable[str] | None = None, *, unset: bool = False,
              help: dict[str, str] | None = None, dest: dict[str, str] | None = None,
              required: Iterable[str] = (), types: dict[str, Callable[[str], Any]] | None = None) -> list[str]:
    """Add one flag per setting of ``cls`` (``names``: those only, in that order) to ``parser`` (or an
    argument group); returns the destinations added.

    Type, choices, help text and default come from the field's definition; the help ends with the
    default, shown once. A ``bool`` setting that defaults to False is a switch (``--compile``), one that
    defaults to True a ``--no-...`` switch (``--no-augment``); a mapping reads a JSON object. ``unset``:
    flags default to None (not given: keep what a preset says; the help still shows the definition's
    default). ``help`` adds a command-specific sentence to a field's help; ``dest`` renames destinations;
    ``required`` fields have no default; ``types`` replaces a field's parser (e.g. an expression check).
    """
    hints = typing.get_type_hints(cls)
    declared = {f.name: f for f in dataclasses.fields(cls)}
    added = []
    for name in (names if names is not None else [n for n, f in declared.items() if f.metadata.get("cli", True)]):
        f = declared[name]
        default = default_of(cls, name)
        default = None if default is MISSING else default  # a required field: no default on the command line
        kwargs = _flag_kwargs(f, base_type(hints[name]), default, unset)
        text = "; ".join(t for t in (f.metadata.get("help", ""), (help or {}).get(name, "")) if t)
        if name in required:
            kwargs.update(required=True, default=None)
        elif kwargs.get("action") == "store_false":
            text = f"turn off: {text}"
        elif default is not None and kwargs.get("action") != "store_true":
            text = f"{text} (default: {_fmt_default(default)})"
        if name in (types or {}):
            kwargs["type"] = types[name]
            kwargs.pop("nargs", None)
        kwargs["help"] = text.replace("%", "%%")
        kwargs["dest"] = (dest or {}).get(name, name)
        flags = [flag_of(f), *f.metadata.get("aliases", ())]
        if kwargs.get("action") == "store_false":
            flags = ["--no-" + name.replace("_", "-")]
        parser.add_argument(*flags, **kwargs)
        added.append(kwargs["dest"])
    return added


def add_bf16_flag(parser) -> None:
    """``--bf16`` beside a command's ``--precision``: the same as ``--precision bf16``, in every command."""
    parser.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                        help="same as --precision bf16")


def _flag_kwargs(f: dataclasses.Field, kind: Any, default: Any, unset: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"default": None if unset else default}
    if kind is bool:
        kwargs["action"] = "store_false" if default else "store_true"
        if unset:
            kwargs["default"] = None
        return kwargs
    if f.metadata.get("choices"):
        kwargs["choices"] = f.metadata["choices"]
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    origin = typing.get_origin(kind) or kind
    if origin is dict:
        kwargs["type"] = _json_object
        kwargs.setdefault("metavar", "JSON")
    elif origin is list:
        kwargs["nargs"] = "+"
    elif kind is float:
        kwargs["type"] = checked(float)  # NaN or infinity is no setting's value
    elif kind is int:
        kwargs["type"] = int
    return kwargs


def from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """``cls`` built from the parsed flags that name its fields (others keep their defaults) and
    ``extra``; a flag left unset (None) where the field's default is not None keeps the default."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if value is None and default_of(cls, f.name) is not None:
                continue
            kwargs[f.name] = value
    return cls(**{**kwargs, **extra})
