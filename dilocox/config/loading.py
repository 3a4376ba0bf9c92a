"""Loading a configuration: YAML files with ``include:``, ``--section.key=value`` overrides, coercion.

``load_config`` reads a YAML file (following its includes, relative to the including file; later
keys win), deep-merges the command-line overrides over it, converts every value to its field's
annotated type (``_coerce``: strings from the command line included; a float must be finite),
builds the dataclasses (unknown keys are refused with the known ones listed) and validates the
result. A key repeated in one YAML mapping is refused (``_UniqueKeyLoader``), and an override of a
string field keeps its text as typed (``--log.wandb_project=2024_01_05``, not YAML's 20240105).
``to_yaml`` writes a config back out (the ``config.yaml`` of a run directory).
"""

from __future__ import annotations

import difflib
import math
import os
import sys
import typing
from dataclasses import fields, is_dataclass
from typing import Any

import yaml

from dilocox.config.checks import ConfigError
from dilocox.config.root import Config, validate

_UNIONS = (typing.Union, getattr(__import__("types"), "UnionType", None))


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (plain YAML keeps the last one silently: a
    second ``train:`` would replace the whole first section). ``where`` names the file in the message."""

    where = "<string>"

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; its keys may be overridden
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the base constructor names it
                    continue
                if first is not None:
                    raise ConfigError(
                        f"{self.where}: key {key!r} is repeated in one mapping (lines {first} and {line}); keep "
                        "one (YAML would silently use the last)"
                    )
                lines[key] = line
        return super().construct_mapping(node, deep)


def _load_yaml(stream: Any, where: str) -> Any:
    """``yaml.safe_load`` with ``_UniqueKeyLoader``: the one way config YAML is read here."""
    loader = _UniqueKeyLoader(stream)
    loader.where = where
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _field_type(dotted: str) -> Any:
    """The annotated type of a dotted config key (``log.wandb_project`` -> str), or None if it names no field."""
    tp: Any = Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(tp) if is_dataclass(tp) else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _coerce(name: str, value: Any, tp: Any, default: Any = None) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError (``default``: the field's, for examples)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0], default)
    if origin is tuple:
        eg = f", e.g. [{', '.join(map(str, default))}]" if isinstance(default, tuple) else ""
        if isinstance(value, str):
            try:
                value = _load_yaml(value, name)
            except yaml.YAMLError:
                raise ConfigError(
                    f"{name}={value!r} is not a valid list; write a list of {len(args)} numbers{eg}"
                ) from None
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{name}={value!r} must be a list of {len(args)} numbers{eg}")
        return tuple(_coerce(f"{name}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # `--model.bias=0`: YAML has made the text "0" an int
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}={value!r} must be a boolean (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be an integer, not a boolean")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
            try:  # `--train.max_tokens=1e9`: YAML 1.1 reads an exponent without a dot as text
                number = float(value)
            except ValueError:
                number = math.nan
            if math.isfinite(number) and number.is_integer():
                return int(number)
        raise ConfigError(f"{name}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be a number, not a boolean")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}={value!r} must be a number")
        if not math.isfinite(number):  # (no field takes nan/inf: none has such a default, no shipped config uses one)
            raise ConfigError(f"{name}={value!r} must be a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}={value!r} must be a string")
    return value


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted config key (``train.seq_len``, ``outer.streaming.fragments``, ...)."""
    hints, out = typing.get_type_hints(cls), []
    for f in fields(cls):
        sub = hints[f.name]
        out += _all_keys(sub, f"{prefix}{f.name}.") if is_dataclass(sub) else [f"{prefix}{f.name}"]
    return out


DOC_NAMES = {"H": "outer.sync_every", "K": "outer.streaming.fragments"}


def _suggest(key: Any, known: dict, prefix: str) -> str:
    """``"; did you mean 'seq_len'?"``: the closest key of the section by edit distance, else the closest dotted key
    of any section (``--train.lr`` -> ``optim.lr``, ``--seq_len`` -> ``train.seq_len``), else ``""``."""
    if str(key) in DOC_NAMES:  # a symbol of README's method table or docs/ALGORITHMS.md, not a key's name
        return f"; did you mean {DOC_NAMES[str(key)]} (the docs' {key})?"
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    every = _all_keys()
    by_last = [k for k in every if k.rsplit(".", 1)[-1] == str(key)]
    close = by_last or difflib.get_close_matches(f"{prefix}{key}", every, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        name = prefix.rstrip(".")
        hint = f"; it is a section: give its keys (`key: value` lines below `{name}:`, or --{name}.KEY=VALUE)"
        raise ConfigError(f"{name or 'config'} must be a mapping, got {data!r}" + (hint if name else ""))
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            where, hint = prefix.rstrip(".") or "the top level", _suggest(key, known, prefix)
            raise ConfigError(f"unknown config key {prefix}{key} (known keys of {where}: {sorted(known)}){hint}")
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, {} if value is None else value, f"{prefix}{key}.")  # (`model:` alone: empty)
        elif isinstance(value, dict):
            raise ConfigError(
                f"{prefix}{key} is a value, not a section (it was given the keys {list(value)}); set it to one "
                f"value, e.g. {prefix}{key}={known[key].default!r}"
            )
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, tp, known[key].default)
    if cls is Config:
        obj = cls.__new__(cls)
        for f in fields(cls):
            setattr(obj, f.name, kwargs.get(f.name, f.default_factory()))  # type: ignore[misc]
        return obj
    return cls(**kwargs)


def _deep_merge(base: dict, over: dict, prefix: str = "") -> dict:
    out = dict(base)
    for k, v in over.items():
        if v is None and isinstance(out.get(k), dict):  # `train:` with its keys commented out: nothing overridden
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v, f"{prefix}{k}.")
        elif isinstance(v, dict) and out.get(k) is not None and is_dataclass(_field_type(f"{prefix}{k}")):
            # (`train: 3` in the file: alone it is refused, and an override of train.steps dropped it silently)
            raise ConfigError(
                f"{prefix}{k} is {out[k]!r} in the config, not a section of keys; write it as {prefix}{k}: followed "
                f"by indented key: value lines (docs/CONFIG.md)"
            )
        else:
            out[k] = v
    return out


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"include cycle: {' -> '.join(seen + (path,))}")
    if not os.path.exists(path):
        hint = ""
        if not seen and not path.endswith((".yaml", ".yml")):  # (`--train.steps 5 CONFIG`: the 5 taken as the file)
            hint = "; the CONFIG file comes first and an override is one word: CONFIG --section.key=value"
        raise ConfigError(f"config file {path!r} does not exist{hint}")
    if os.path.isdir(path):
        ymls = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
        raise ConfigError(
            f"config {path!r} is a directory; give a YAML file"
            + (f", e.g. {os.path.join(path, ymls[0])}" if ymls else "")
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = _load_yaml(f, path)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"malformed YAML in {path}: {' '.join(str(e).split())}") from None
    if data is None:  # empty or only comments
        print(f"warning: config file {path} is empty; using the defaults (docs/CONFIG.md)", file=sys.stderr)
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(
            f"{path}: include must be a file name or a list of file names (relative to this file), got {includes!r}; "
            "e.g. include: model/gpt2-tiny.yaml"
        )
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, _read_yaml(os.path.join(os.path.dirname(path), inc), seen + (path,)))
    return _deep_merge(merged, data)


def _override_value(key: str, raw: str) -> Any:
    """An override's value: its text as typed for a string field (``0755`` stays ``'0755'``; ``null``/``~`` is None
    where the field allows None; a quoted text is unquoted), else parsed as YAML (an unparsable text stays text)."""
    tp = _field_type(key)
    text = tp is str or (typing.get_origin(tp) in _UNIONS and set(typing.get_args(tp)) == {str, type(None)})
    if text and not (len(raw) >= 2 and raw[0] in "'\"" and raw[-1] == raw[0]):
        return None if tp is not str and raw in ("~", "null", "Null", "NULL") else raw
    try:
        return _load_yaml(raw, f"--{key}") if raw != "" else ""
    except yaml.YAMLError:
        return raw


def parse_overrides(args: list[str]) -> dict:
    """``["--train.steps=10", "--model.arch", "opt"]`` -> nested dict (values parsed as YAML, but a string field
    keeps its text: ``_override_value``)."""
    out: dict = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or a == "--":
            raise ConfigError(f"override {a!r} must look like --section.key=value")
        body = a[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            last = i + 1 >= len(args) or args[i + 1].startswith("--")  # (--verbose: no section.key, no value)
            if "." not in body and _field_type(body) is None and last:
                raise ConfigError(f"unknown option {a!r}: a config override is --section.key=VALUE (--help lists both)")
            if i + 1 >= len(args):
                raise ConfigError(f"override {a!r} has no value; write --{body}=VALUE")
            key, raw = body, args[i + 1]
            i += 1
        value = _override_value(key, raw)
        node = out
        parts = key.split(".")
        for j, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                path = ".".join(parts[: j + 1])
                raise ConfigError(
                    f"override --{key}: {path} is a value, not a section; set it with --{path}=VALUE"
                    if _field_type(path) is not None and not is_dataclass(_field_type(path))
                    else f"override --{key}: an earlier override set {path} to {node!r}; give only keys under it"
                )
        node[parts[-1]] = value
        i += 1
    return out


def from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Load a YAML config (with includes), apply overrides, validate."""
    data = _read_yaml(path) if path else {}
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _deep_merge(data, ov)
    return from_dict(data)


def to_yaml(cfg: Config) -> str:
    def conv(x: Any) -> Any:
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return yaml.safe_dump(conv(cfg.to_dict()), sort_keys=False)
