"""TOML profiles and ``--set`` overrides, read into a validated :class:`~mcfn.config.RunConfig`.

A profile has one table per section (``[model]``, ``[data]``, ``[optim]``, ``[train]``, ``[mc]`` with its own
``[mc.gist]``, ``[mc.lens]``, ``[mc.alloc]`` and ``[mc.teacher]`` tables, and ``[lens_stage]``). Unknown sections or
keys, values of the wrong type and out-of-range values are rejected with a one-line :class:`~mcfn.errors.UserError`
that names the key.

A profile may start from another: ``extends = "default"`` at its top takes that profile's tables, and its own
tables then override them key by key, so it says only what differs.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from mcfn.config import DataConfig, LensStageConfig, MCConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from mcfn.errors import UserError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
DEFAULT_PROFILE = "default"

_SECTION_TYPES = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "mc": MCConfig,
    "lens_stage": LensStageConfig,
}


def _coerce(key: str, value: Any, expected: type) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool:
        raise UserError(f"invalid value for {key}: expected {expected.__name__}, got a boolean")
    if not isinstance(value, expected):
        raise UserError(f"invalid value for {key}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


COMMAND_LINE = "the command line (--set)"


def _where(full: str, source: str, overridden: frozenset[str]) -> str:
    """Where a setting came from: the command line where an override set it (or a key under it), else ``source``."""
    return COMMAND_LINE if any(o == full or o.startswith(f"{full}.") for o in overridden) else source


def _build_table(cls: type, values: dict[str, Any], prefix: str, source: str, overridden: frozenset[str]) -> Any:
    """One config dataclass from a TOML table, its nested tables (``[mc.lens]``) built the same way."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        full = f"{prefix}.{key}"
        nested = dataclasses.is_dataclass(types.get(key))
        if key not in fields or fields[key].metadata.get("derived"):
            raise UserError(f"unknown key {full} in {_where(full, source, overridden)}")
        if nested:
            if not isinstance(value, dict):
                raise UserError(f"{full} in {_where(full, source, overridden)} must be a table ([{full}])")
            kwargs[key] = _build_table(types[key], value, full, source, overridden)
        else:
            kwargs[key] = _coerce(full, value, types[key])
    return cls(**kwargs)


def build_config(
    sections: dict[str, dict[str, Any]], source: str = "config", overridden: frozenset[str] = frozenset()
) -> RunConfig:
    """Build a RunConfig from nested ``{section: {key: value}}``, rejecting anything unknown; an error names where the
    setting came from: ``source``, or the command line for the dotted keys in ``overridden``."""
    built: dict[str, Any] = {}
    for section, values in sections.items():
        where = _where(section, source, overridden)
        if section not in _SECTION_TYPES:
            raise UserError(f"unknown section [{section}] in {where} (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(values, dict):
            raise UserError(f"[{section}] in {where} must be a table")
        built[section] = _build_table(_SECTION_TYPES[section], values, section, source, overridden)
    return RunConfig(**built)


def _from_saved(cls: type, values: dict[str, Any]) -> Any:
    types = typing.get_type_hints(cls)
    return cls(**{k: _from_saved(types[k], v) if dataclasses.is_dataclass(types[k]) else v for k, v in values.items()})


ANY_VALUE = object()
# Knobs taken out of the config, each with the value the code now fixes (ANY_VALUE: one that never changed what a
# run computes: where files went, what it logged). A saved config that holds one still loads when it holds that
# value, as every run trained before the knob went does; another value is refused, since the code cannot honour it.
RETIRED: dict[str, Any] = {
    "model.softcap": 15.0,
    "model.rope_base": 10000.0,
    "data.cache_dir": ANY_VALUE,
    "optim.gain_lr": 0.02,
    "optim.weight_decay": 0.0,
    "optim.adam_beta1": 0.8,
    "optim.adam_beta2": 0.95,
    "optim.warmup_frac": 0.0,
    "optim.final_lr_frac": 0.05,
    "train.wandb_project": ANY_VALUE,
    "train.max_bad_steps": ANY_VALUE,
    "train.final_eval_probe_batches": ANY_VALUE,
    "train.memory_snapshot_steps": ANY_VALUE,
    "mc.gist.kind": "gistnet",
    "mc.gist.source": "embedding",
    "mc.lens.weight": 1.0,
    "mc.lens.pref_weight": 1.0,
    "mc.lens.budget_weight": 0.1,
    "mc.lens.temperature": 0.5,
    "mc.lens.every": 1,
    "lens_stage.states_per_batch": 16,  # constants of the stage since 2026-11-29 (mcfn.stage.rounds, .traces)
    "lens_stage.random_cuts": 2,
    # Experiments that lost their A/B (LABLOG); each can be rerun at commit 8ab6b6c.
    "mc.lens.match_feature": False,
    "mc.lens.horizons": "tail",
    "mc.teacher.stretch": 0,
    "mc.lens.pair_weight": 0.0,
    "mc.leave_out": "top",
    # The twenty-ninth session's design stage, rerun at commit 619f6f1: which of the teacher's attention LensNet was
    # fitted to. Only that commit's runs hold it, and it changed their training alone: the indexer now fixes "far"
    # (mcfn.core.attention.AttentionTarget.of), every other LensNet "tail".
    "mc.lens.attention_target": ANY_VALUE,
    # The thirty-second session's design stage, rerun at commit e983532: the indexer's attention target fitted
    # through a learned sharpness ("tempered") or over its 4 entries of most mass ("top"); both lost to the target as
    # it stands (LABLOG). A "tempered" run's LensNet holds one more weight, target_gain (a scale its loss read and
    # its cut never did): such a checkpoint loads at that commit only.
    "mc.lens.target_form": ANY_VALUE,
    # The thirty-fourth session's lever, rerun at commit 6afd300: LensNet trained on cuts at the tail's refocus points,
    # judged on the tokens each serves; its text gained 0.016 bpb and seed 2 lost the pass key (LABLOG).
    "mc.lens.cadence": False,
    # Knobs no profile or flag set (issue 57); rerun at commit 8f932ca. GistNet's and LensNet's shape now follows
    # the model's width (RunConfig.aux_width, aux_heads): the same as these defaults below a width of 384.
    "mc.gist.layers": 2,
    "mc.gist.width": 0,
    "mc.gist.heads": 2,
    "mc.lens.layers": 2,
    "mc.lens.width": 0,
    "mc.lens.heads": 2,
    "mc.gist.recon_tokens": 512,
    "mc.alloc.variants": 1,
    "optim.grad_clip": 1.0,
    "train.final_eval": ANY_VALUE,  # now train.final_eval_batches = 0
    "train.ckpt_every": ANY_VALUE,  # a checkpoint now follows every validation
    "train.lod_map_every": ANY_VALUE,  # the LOD maps now come with every validation
    # Induction levers that lost the screen (issue 64; LABLOG, twentieth session); rerun at commit aaedb6e.
    "model.smear": False,
    "model.mimetic": False,
    "model.gain_init": 1.0,
    # Knobs no profile or flag set (issue 65), now constants; rerun at commit a1af014. Muon's rate: 0.03 lost on the
    # slowest seed (LABLOG, twenty-third session). The tokenizer's sample: mcfn.data.corpus.TOKENIZER_TRAIN_CHARS.
    # Activation checkpointing: no profile or measurement ever turned it on; the step fits without it.
    "optim.matrix_lr": 0.02,
    "data.tokenizer_train_chars": 20_000_000,
    "train.activation_checkpointing": False,
    # Where a run executes and how it is watched are flags of train.run (--device, --memory-snapshot), not config.
    "train.device": ANY_VALUE,
    "train.memory_snapshot": ANY_VALUE,
}

# Knobs that moved, from their old dotted key to the new one (a saved config is read under the new).
MOVED: dict[str, str] = {"train.lens_rounds": "lens_stage.rounds"}


# Knobs added since a checkpoint may have been saved, with the value that reproduces what such a run did.
ADDED: dict[str, Any] = {"data.test_fraction": 0.0, "model.key_smear": False}


def with_added(tables: dict[str, Any]) -> dict[str, Any]:
    """A saved config's tables with every :data:`MOVED` knob under its new key, every :data:`ADDED` knob it
    predates set to its old meaning, and every section it predates at its defaults."""
    tables = {name: dict(values) if isinstance(values, dict) else values for name, values in tables.items()}
    for old, new in MOVED.items():
        (old_section, old_key), (section, key) = old.split(".", 1), new.split(".", 1)
        if old_key in tables.get(old_section, {}):
            tables.setdefault(section, {})[key] = tables[old_section].pop(old_key)
    for dotted, value in ADDED.items():
        section, key = dotted.split(".", 1)
        tables.get(section, {}).setdefault(key, value)
    for section in _SECTION_TYPES:
        tables.setdefault(section, {})
    return tables


def without_retired(tables: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A saved config's tables without the :data:`RETIRED` keys; a ``UserError`` if one holds another value."""
    kept = {}
    for key, value in tables.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = without_retired(value, f"{name}.")
        elif name not in RETIRED:
            kept[key] = value
        elif RETIRED[name] is not ANY_VALUE and value != RETIRED[name]:
            raise UserError(
                f"the checkpoint was trained with {name}={value!r}; this mcfn fixes it at {RETIRED[name]!r}"
            )
    return kept


def config_from_saved(sections: dict[str, dict[str, Any]]) -> RunConfig:
    """The config a checkpoint was written with, derived fields included (the file is ours, not the user's)."""
    sections = with_added(without_retired(sections))
    try:
        return RunConfig(**{name: _from_saved(cls, sections[name]) for name, cls in _SECTION_TYPES.items()})
    except (KeyError, TypeError) as e:
        raise UserError(f"checkpoint config does not match this version of mcfn ({e})") from None


def profile_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml":
        return path
    return PROFILES_DIR / f"{name}.toml"


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s keys on top, table by table."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_profile(name: str, seen: tuple[Path, ...] = ()) -> dict[str, dict[str, Any]]:
    """Read a profile by name (``profiles/NAME.toml``) or by path to a ``.toml`` file, on top of the profile it
    ``extends`` (named as profiles are, a relative path from the profile's folder)."""
    path = profile_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
        raise UserError(f"no profile {name!r} (looked for {path}; known: {', '.join(known)})")
    if path.resolve() in seen:
        raise UserError(f"profile {path} extends itself (through {', '.join(p.name for p in seen)})")
    try:
        with path.open("rb") as f:
            tables = tomllib.load(f)
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read profile {path}: {e}") from None
    parent = tables.pop("extends", None)
    if parent is None:
        return tables
    if not isinstance(parent, str):
        raise UserError(f"extends in {path} must be a profile name")
    parent_name = parent if not parent.endswith(".toml") else str(path.parent / parent)
    return merged(load_profile(parent_name, (*seen, path.resolve())), tables)


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
    overridden = frozenset(f"{section}.{key}" for section, key, _ in overrides)
    return build_config(sections, source=str(profile_path(profile)), overridden=overridden)
