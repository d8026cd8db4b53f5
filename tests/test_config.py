from pathlib import Path

import pytest

from mcfn.config import PROFILES_DIR, RunConfig, build_config, parse_override, resolve
from mcfn.errors import UserError


def test_every_shipped_profile_resolves():
    names = sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
    assert {"cpu-tiny", "cpu-small", "gpu-h100"} <= set(names)
    for name in names:
        assert isinstance(resolve(name, []), RunConfig)


def test_overrides_apply_after_profile_in_order():
    cfg = resolve(
        "cpu-tiny",
        [
            parse_override("train.steps=7"),
            parse_override("train.steps=9"),
            parse_override("data.source=text:/somewhere"),
            parse_override("optim.matrix_lr=1"),
        ],
    )
    assert cfg.train.steps == 9
    assert cfg.data.source == "text:/somewhere"
    assert cfg.optim.matrix_lr == 1.0 and isinstance(cfg.optim.matrix_lr, float)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"train": {"stepz": 3}}, "unknown key train.stepz"),
        ({"trian": {"steps": 3}}, "unknown section [trian]"),
        ({"model": {"vocab_size": 100}}, "unknown key model.vocab_size"),  # derived from the tokenizer
        ({"train": {"steps": "many"}}, "train.steps: expected int"),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1"),
        ({"train": {"compile": 1}}, "train.compile: expected bool"),
        ({"model": {"n_embd": 100, "n_head": 3}}, "model.n_embd"),
        ({"data": {"val_fraction": 1.5}}, "data.val_fraction"),
        ({"train": {"compile_mode": "fast"}}, "train.compile_mode"),
        ({"optim": {"warmup_frac": 0.8, "warmdown_frac": 0.5}}, "optim.warmdown_frac"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(sections, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_config(sections)


def test_unknown_profile_lists_known_ones():
    with pytest.raises(UserError, match="known: .*cpu-tiny"):
        resolve("no-such-profile", [])


def test_malformed_profile_file(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = ")
    with pytest.raises(UserError, match="cannot read profile"):
        resolve(str(bad), [])


def test_override_syntax():
    assert parse_override("train.compile=true") == ("train", "compile", True)
    assert parse_override("data.source=stdlib") == ("data", "source", "stdlib")  # bare word: a string
    with pytest.raises(UserError, match="section.key=value"):
        parse_override("steps=3")
