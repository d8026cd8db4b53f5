"""TOML profiles and ``--set`` overrides, read into a validated :class:`~mcfn.config.RunConfig`.

A profile has one table per section (``[model]``, ``[data]``, ``[optim]``, ``[train]``, ``[mc]``, the last with
its own ``[mc.gist]``, ``[mc.lens]`` and ``[mc.alloc]`` tables). Unknown sections or keys, values of the wrong
type and out-of-range values are rejected with a one-line :class:`~mcfn.errors.UserError` that names the key.
Keys from before the ``[mc]`` split are rejected with the new key's name (``mc.lens_weight`` is now
``mc.lens.weight``); checkpoints written before it still load.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from mcfn.config import DataConfig, MCConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from mcfn.errors import UserError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
DEFAULT_PROFILE = "cpu-tiny"

# The flat keys of the [mc] table before it was split into [mc.gist], [mc.lens] and [mc.alloc].
RENAMED = {
    "mc.gist_layers": "mc.gist.layers",
    "mc.gist_width": "mc.gist.width",
    "mc.gist_heads": "mc.gist.heads",
    "mc.lens": "mc.lens.enabled",
    **{
        f"mc.lens_{key}": f"mc.lens.{key}"
        for key in (
            "layers",
            "width",
            "heads",
            "weight",
            "pref_weight",
            "budget_weight",
            "rank",
            "rank_weight",
            "rank_margin",
            "temperature",
            "every",
        )
    },
    "mc.alloc_variants": "mc.alloc.variants",
    "mc.alloc_iterations": "mc.alloc.iterations",
    "mc.alloc_noise": "mc.alloc.noise",
}


_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig, "mc": MCConfig}


def _coerce(key: str, value: Any, expected: type) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool:
        raise UserError(f"invalid value for {key}: expected {expected.__name__}, got a boolean")
    if not isinstance(value, expected):
        raise UserError(f"invalid value for {key}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build_table(cls: type, values: dict[str, Any], prefix: str, source: str) -> Any:
    """One config dataclass from a TOML table, its nested tables (``[mc.lens]``) built the same way."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        full = f"{prefix}.{key}"
        nested = dataclasses.is_dataclass(types.get(key))
        if full in RENAMED and (key not in fields or (nested and not isinstance(value, dict))):
            raise UserError(f"{full} in {source} is now {RENAMED[full]}")
        if key not in fields or fields[key].metadata.get("derived"):
            raise UserError(f"unknown key {full} in {source}")
        if nested:
            if not isinstance(value, dict):
                raise UserError(f"{full} in {source} must be a table ([{full}])")
            kwargs[key] = _build_table(types[key], value, full, source)
        else:
            kwargs[key] = _coerce(full, value, types[key])
    return cls(**kwargs)


def build_config(sections: dict[str, dict[str, Any]], source: str = "config") -> RunConfig:
    """Build a RunConfig from nested ``{section: {key: value}}``, rejecting anything unknown."""
    built: dict[str, Any] = {}
    for section, values in sections.items():
        if section not in _SECTION_TYPES:
            raise UserError(f"unknown section [{section}] in {source} (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(values, dict):
            raise UserError(f"[{section}] in {source} must be a table")
        built[section] = _build_table(_SECTION_TYPES[section], values, section, source)
    return RunConfig(**built)


def _nest_flat_mc(mc: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``mc`` table written before the split, in today's nested form."""
    out: dict[str, Any] = {}
    for key, value in mc.items():
        renamed = RENAMED.get(f"mc.{key}") if not isinstance(value, dict) else None  # "lens" was a bool
        dotted = (renamed or f"mc.{key}").split(".")[1:]
        table = out
        for part in dotted[:-1]:
            table = table.setdefault(part, {})
        table[dotted[-1]] = value
    return out


def _from_saved(cls: type, values: dict[str, Any]) -> Any:
    types = typing.get_type_hints(cls)
    return cls(**{k: _from_saved(types[k], v) if dataclasses.is_dataclass(types[k]) else v for k, v in values.items()})


# Keys added with a default other than what came before: a checkpoint written without one ran the old way.
ADDED_WITH_A_NEW_DEFAULT = {("lens", "granularity"): "entry"}


def config_from_saved(sections: dict[str, dict[str, Any]]) -> RunConfig:
    """The config a checkpoint was written with, derived fields included (the file is ours, not the user's)."""
    try:
        sections = {**sections, "mc": _nest_flat_mc(sections["mc"])}
        for (table, key), before in ADDED_WITH_A_NEW_DEFAULT.items():
            sections["mc"].setdefault(table, {}).setdefault(key, before)
        return RunConfig(**{name: _from_saved(cls, sections[name]) for name, cls in _SECTION_TYPES.items()})
    except (KeyError, TypeError) as e:
        raise UserError(f"checkpoint config does not match this version of mcfn ({e})") from None


def profile_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml":
        return path
    return PROFILES_DIR / f"{name}.toml"


def load_profile(name: str) -> dict[str, dict[str, Any]]:
    """Read a profile by name (``profiles/NAME.toml``) or by path to a ``.toml`` file."""
    path = profile_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
        raise UserError(f"no profile {name!r} (looked for {path}; known: {', '.join(known)})")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read profile {path}: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` with a TOML value; a bare word that is not TOML is taken as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def resolve(profile: str, overrides: list[tuple[str, str, Any]]) -> RunConfig:
    """Profile values first, then overrides (in order); validated once, at the end."""
    sections = load_profile(profile)
    for section, key, value in overrides:
        table = sections.setdefault(section, {})
        *parents, last = key.split(".")  # mc.lens.weight: key weight of the [mc.lens] table
        for part in parents:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise UserError(f"override {section}.{key}: {section}.{part} is not a table")
        table[last] = value
    return build_config(sections, source=str(profile_path(profile)))
