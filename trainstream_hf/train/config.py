"""Recipe configuration: typed dataclasses filled from a YAML file plus command-line overrides.

A recipe declares its options as a dataclass whose fields may themselves be dataclasses (sections). The
YAML file mirrors it; any field can then be overridden on the command line, sections with dotted keys::

    python recipes/sft.py --config configs/sft-tiny-cpu.yaml --train.steps 50 --init random \\
        --trainstream.page_weights false --train.betas [0.9,0.95]

Values on the command line are read as YAML (``5`` is an int, ``0.003`` and ``3e-3`` are floats, ``true``
a bool, ``null`` None, ``[1, 2]`` a list), then checked against the field's type annotation. Unknown keys
and ill-typed values are errors that name the option and what it accepts; the dataclasses' own
``__post_init__`` checks values (``TrainStreamConfig`` validates the ``trainstream`` section that way).
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

__all__ = ["ConfigError", "MissingFileError", "build", "load", "parse_args", "parse_overrides", "to_dict",
           "help_text", "read_command_comment", "with_default_config"]

T = TypeVar("T")


class ConfigError(ValueError):
    """An option that does not exist, or a value of the wrong type or outside the allowed values."""


class MissingFileError(ConfigError, FileNotFoundError):
    """An option names a file that is not there (a ConfigError, and a FileNotFoundError as ``open`` would raise)."""


# -- reading ------------------------------------------------------------------------------------------
def read_command_comment(path: str | Path) -> str | None:
    """The command in a config's first line (``# python recipes/sft.py --config ...``), or None."""
    first = Path(path).read_text().splitlines()[:1]
    if not first or not first[0].startswith("#"):
        return None
    return first[0].lstrip("#").strip() or None


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--a.b", "1", "--c=x"]`` -> ``{"a.b": 1, "c": "x"}``; each value is parsed as YAML."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an option like --train.steps 10, got {arg!r}")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"option --{arg[2:]} needs a value (e.g. --{arg[2:]} true)")
            key, text = arg[2:], args[i + 1]
            i += 2
        try:
            out[key] = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            out[key] = text  # not YAML (e.g. an unbalanced bracket in a path): keep it as a string
    return out


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"--{key}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def load(cls: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Builds ``cls`` from a YAML file (optional) with ``overrides`` (dotted key -> value) applied on top."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--config: no such file {str(p)!r}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:  # one line: the file, the place, what is wrong
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{p}:{where}: not valid YAML ({getattr(err, 'problem', None) or err}); an option "
                              "is written `name: value`, nested under its section by two spaces") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of options, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return build(cls, data)


def parse_args(cls: type[T], argv: list[str] | None = None, *, description: str = "") -> T:
    """``--config FILE`` plus ``--key value`` overrides -> ``cls``. ``-h`` / ``--help`` prints every option."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(cls, description))
        raise SystemExit(0)
    path = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML file")
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return load(cls, path, parse_overrides(rest))


def with_default_config(argv: list[str] | None, default: str, prog: str) -> list[str]:
    """``argv`` (None: ``sys.argv[1:]``) with ``--config default`` in front when it names no config, after one line on
    stderr saying so: a recipe run bare runs its demo, and says which file that is, rather than options nobody chose.

    Raises:
        ConfigError: no --config, and ``default`` is not there (the recipes run from the repository root).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "--config") or a.startswith("--config=") for a in argv):
        return argv
    if not Path(default).is_file():
        raise ConfigError(f"no --config given, and the demo config {default} is not under {str(Path.cwd())!r}: run "
                          "from the repository root, or pass --config <file>")
    print(f"{prog}: no --config given; running {default} (the demo). Pass --config <file> to choose another.",
          file=sys.stderr, flush=True)
    return ["--config", default, *argv]


# -- building and type checking -------------------------------------------------------------------------
def build(cls: type[T], data: dict, prefix: str = "") -> T:
    """``cls(**data)`` with nested sections built recursively, unknown keys refused and values type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a section (mapping), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        near = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
        of = f" of {prefix.rstrip('.')}" if prefix else ""
        raise ConfigError(f"unknown option {prefix}{key}{hint}; the options{of} are: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        section = _section_type(hint)
        if section is not None and isinstance(value, dict):
            kwargs[name] = build(section, value, f"{prefix}{name}.")
        elif section is not None and value is not None:
            raise ConfigError(f"{prefix}{name}: a section; give its options as {prefix}{name}.<option> "
                              f"({', '.join(f.name for f in dataclasses.fields(section))})")
        elif isinstance(value, dict) and hint is not Any and dict not in _union_args(hint):
            raise ConfigError(f"{prefix}{name} is a value, not a section: expected {_describe(hint)}")
        else:
            kwargs[name] = _check(value, hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        where = f"{prefix.rstrip('.')}: " if prefix else ""
        raise ConfigError(f"{where}{e}") from e


def _union_args(hint) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _section_type(hint) -> type | None:
    for a in _union_args(hint):
        if dataclasses.is_dataclass(a):
            return a
    return None


def _describe(hint) -> str:
    parts = []
    for a in _union_args(hint):
        if typing.get_origin(a) is Literal:
            parts.append(" | ".join(repr(v) for v in typing.get_args(a)))
        elif a is type(None):
            parts.append("null")
        elif typing.get_origin(a) in (tuple, list):
            inner = typing.get_args(a)
            parts.append(f"a list [{', '.join(_describe(x) for x in inner if x is not Ellipsis)}]" if inner
                         else "a list")
        else:
            parts.append(getattr(a, "__name__", str(a)))
    return " or ".join(parts)


def _check(value: Any, hint, name: str) -> Any:
    """``value`` converted to a type ``hint`` allows (int -> float, '3e-4' -> float, list -> tuple)."""
    if hint is Any:
        return value
    allowed = _union_args(hint)
    fail = ConfigError(f"{name}: expected {_describe(hint)}, got {value!r}")
    for a in allowed:
        if typing.get_origin(a) is Literal and any(value == v and type(value) is type(v) for v in typing.get_args(a)):
            return value
    if value is None:
        if type(None) in allowed:
            return None
        raise fail
    if isinstance(value, bool):
        if bool in allowed:
            return value
        raise fail
    if isinstance(value, int) and int in allowed:
        return value
    if isinstance(value, int) and str in allowed and float not in allowed:
        return str(value)  # "--output_dir 2024": YAML read a number, the option takes text
    if isinstance(value, (int, float)) and float in allowed:
        return float(value)
    if isinstance(value, str):
        if str in allowed:
            return value
        for t in (int, float):  # YAML 1.1 reads 3e-4 (no dot) as a string
            if t in allowed:
                try:
                    return t(value)
                except ValueError:
                    pass
        raise fail
    if isinstance(value, (list, tuple)):
        for a in allowed:
            origin = typing.get_origin(a) or a
            if origin in (tuple, list):
                inner = typing.get_args(a)
                if inner and Ellipsis not in inner and origin is tuple:
                    if len(inner) != len(value):
                        raise fail
                    items = [_check(v, t, f"{name}[{i}]") for i, (v, t) in enumerate(zip(value, inner))]
                else:
                    t = inner[0] if inner else Any
                    items = [_check(v, t, f"{name}[{i}]") for i, v in enumerate(value)]
                return origin(items)
    raise fail


# -- writing ----------------------------------------------------------------------------------------
def to_dict(obj: Any) -> Any:
    """A config as plain YAML/JSON values (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def help_text(cls: type, description: str = "") -> str:
    """Every option of ``cls`` (dotted for sections) with its type, default and help."""
    lines = [description.strip(), "", "usage: --config FILE.yaml [--option value ...]", "", "options:"]

    def walk(c, prefix, instance):
        # Defaults are read from a default instance where there is one: a recipe may give a section other defaults
        # than the section class's own (dpo's lora.r is 8).
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            section = _section_type(hints[f.name])
            if section is not None:
                walk(section, f"{prefix}{f.name}.", getattr(instance, f.name, None))
                continue
            if instance is not None:
                default = getattr(instance, f.name)
            else:
                default = f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
            lines.append(f"  --{prefix}{f.name}  ({_describe(hints[f.name])}; default {default!r})")
            if f.metadata.get("help"):
                lines.append(f"        {f.metadata['help']}")

    try:
        defaults = cls()
    except (TypeError, ValueError):  # required options, or defaults that only validate together with a config
        defaults = None
    walk(cls, "", defaults)
    return "\n".join(lines).strip()


def run_cli(main, prog: str) -> None:
    """A recipe's ``__main__``: runs ``main()``; a bad option or a missing input exits with its message (naming it),
    not a traceback that would only bury it."""
    try:
        main()
    except (ConfigError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
