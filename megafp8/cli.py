"""Megatron-compatible flags and YAML run files -> Config.

Every config field is a flag named as Megatron names it: ``tensor_model_parallel_size`` is
``--tensor-model-parallel-size``. Booleans that default to False are switches (``--swiglu``,
``--sequence-parallel``, ``--bf16``); those that default to True have a ``--no-...`` switch (and
accept the plain one, e.g. ``--cross-entropy-loss-fusion``), and Megatron's
``--disable-bias-linear`` is accepted too. ``--config run.yaml`` reads a run file
whose keys
are either sections (``model: {num_layers: 2}``) or flat field names (``num_layers: 2`` or
``num-layers: 2``). Precedence: defaults < run file < flags. Unknown flags or keys are errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from dataclasses import fields

import yaml

from megafp8 import megatron_compat
from megafp8.config import Config, all_fields

ALIASES = {"disable_bias_linear": ("model", "add_bias_linear", False)}


def _field_table() -> dict[str, tuple[str, dataclasses.Field, type]]:
    """field name -> (section, field, python type)."""
    hints = {
        sec.name: typing.get_type_hints(sec.default_factory) for sec in dataclasses.fields(Config)
    }
    return {name: (sec, f, hints[sec][name]) for name, (sec, f) in all_fields().items()}


def _base_type(tp):
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(tp) or tp


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``error: ...``, exit status 2), like every other
    bad input, instead of the usage block."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="megafp8 GPT pretraining", allow_abbrev=False)
    p.add_argument("--config", help="YAML run file (sections or flat keys)")
    for name, (sec, f, tp) in _field_table().items():
        flag = "--" + name.replace("_", "-")
        base, desc = _base_type(tp), f.metadata["help"]
        if base is bool:
            if f.default:
                p.add_argument(
                    "--no-" + name.replace("_", "-"),
                    dest=name,
                    action="store_const",
                    const=False,
                    default=None,
                    help=f"[{sec}] turn off: {desc} (on by default)",
                )
                p.add_argument(  # accepted for scripts that name it (Megatron's flags)
                    flag,
                    dest=name,
                    action="store_const",
                    const=True,
                    default=None,
                    help=f"[{sec}] {desc} (on by default)",
                )
            else:
                p.add_argument(
                    flag,
                    dest=name,
                    action="store_const",
                    const=True,
                    default=None,
                    help=f"[{sec}] {desc}",
                )
        elif base is tuple:
            dflt = f" (default: {f.default!r})" if f.default else ""
            p.add_argument(flag, dest=name, nargs="+", default=None, help=f"[{sec}] {desc}{dflt}")
        else:
            choices = f.metadata["choices"]
            p.add_argument(
                flag,
                dest=name,
                type=base,
                default=None,
                choices=[c for c in choices if c is not None] if choices else None,
                help=f"[{sec}] {desc} (default: {f.default!r})",
            )
    p.add_argument(
        "--disable-bias-linear",
        dest="disable_bias_linear",
        action="store_true",
        default=None,
        help="[model] no biases in linear layers",
    )
    megatron_compat.add_flags(p)
    return p


def _coerce(name: str, value, tp):
    base = _base_type(tp)
    if value is None:
        return None
    if base is tuple:
        return tuple(
            str(v) for v in (value if isinstance(value, (list, tuple)) else str(value).split())
        )
    if base is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true/false, got {value!r}")
        return value
    try:
        return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {base.__name__}, got {value!r}") from None


def _flatten_run_file(d: dict, path: str) -> dict:
    table, sections = _field_table(), {f.name for f in fields(Config)}
    flat = {}
    for k, v in (d or {}).items():
        key = str(k).replace("-", "_")
        if key in sections and isinstance(v, dict):
            for kk, vv in v.items():
                kk = str(kk).replace("-", "_")
                if kk not in table or table[kk][0] != key:
                    raise ValueError(f"{path}: unknown key '{kk}' in section '{key}'")
                flat[kk] = vv
        elif key in table or key in ALIASES:
            flat[key] = v
        else:
            raise ValueError(f"{path}: unknown key '{k}'")
    return flat


def config_from_values(values: dict) -> Config:
    """Flat {field: value} -> Config, coercing types; unknown names raise ValueError."""
    table = _field_table()
    sections: dict[str, dict] = {}
    for name, v in values.items():
        if name in ALIASES:
            if v:
                sec, field, val = ALIASES[name]
                sections.setdefault(sec, {})[field] = val
            continue
        if name not in table:
            raise ValueError(f"unknown config key '{name}'")
        sec, _, tp = table[name]
        sections.setdefault(sec, {})[name] = _coerce(name, v, tp)
    return Config().replace(**sections)


def _megatron_run_file(d, path: str) -> list[str] | None:
    """A Megatron-style run file (``MODEL_ARGS: {--num-layers: 32, ...}``, groups of flags
    named as on the command line, or such flags at the top) -> argv; None for our own format.
    ``true``/null: a switch; ``false``: left out; a list: several values."""
    if not isinstance(d, dict):
        return None
    blocks = [d] + [v for v in d.values() if isinstance(v, dict)]
    if not any(str(k).startswith("--") for b in blocks for k in b):
        return None
    argv: list[str] = []
    for key, v in d.items():
        for flag, val in v.items() if isinstance(v, dict) else [(key, v)]:
            if not str(flag).startswith("--"):
                raise ValueError(f"{path}: '{flag}' under '{key}': flags are written --name")
            if val is False:
                continue
            argv.append(str(flag))
            if isinstance(val, list):
                argv += [str(x) for x in val]
            elif val is not True and val is not None:
                argv.append(str(val))
    return argv


def parse_args(argv=None, notices: list | None = None) -> Config:
    """Flags (and ``--config``) -> Config. Parse errors exit 2 with one line; bad values and
    refused Megatron flags raise ValueError. ``notices`` collects one line per Megatron flag that
    has no effect here (printed on rank 0 when not given)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    values: dict = {}
    if ns.config:
        with open(ns.config) as f:
            doc = yaml.safe_load(f)
        megatron = _megatron_run_file(doc, ns.config)
        if megatron is not None:  # flags of the file first, so the command line overrides them
            ns = parser.parse_args(megatron + argv)
        else:
            values.update(_flatten_run_file(doc, ns.config))
    compat = {}
    for k, v in vars(ns).items():
        if v is None or k == "config":
            continue
        if k in megatron_compat.BY_DEST:
            compat[k] = v
        else:
            values[k] = v
    found = megatron_compat.resolve(compat, values)
    if notices is not None:
        notices.extend(found)
    elif os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        for n in found:
            print(f"notice: {n}", file=sys.stderr)
    return config_from_values(values)


def dump_yaml(cfg: Config) -> str:
    d = cfg.to_dict()
    for sec in d.values():
        for k, v in sec.items():
            if isinstance(v, tuple):
                sec[k] = list(v)
    return yaml.safe_dump(d, sort_keys=False)
