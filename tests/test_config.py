import json
from pathlib import Path

import pytest

from mcfn.config import RunConfig
from mcfn.errors import UserError
from mcfn.profile import PROFILES_DIR, build_config, parse_override, resolve


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


def test_nested_mc_tables_and_overrides():
    cfg = resolve("cpu-tiny", [parse_override("mc.lens.weight=2"), parse_override("mc.alloc.noise=0.5")])
    assert cfg.mc.lens.weight == 2.0 and cfg.mc.alloc.noise == 0.5 and cfg.mc.gist.layers == 2
    assert cfg.flat()["mc.lens.weight"] == 2.0
    off = build_config({"mc": {"lens": {"enabled": False}}})
    assert not off.mc.lens.enabled and off.mc.alloc_variants == 0


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"mc": {"lens_weight": 2.0}}, "mc.lens_weight in config is now mc.lens.weight"),
        ({"mc": {"gist_layers": 1}}, "mc.gist_layers in config is now mc.gist.layers"),
        ({"mc": {"alloc_iterations": 2}}, "mc.alloc_iterations in config is now mc.alloc.iterations"),
        ({"mc": {"lens": False}}, "mc.lens in config is now mc.lens.enabled"),
        ({"mc": {"lens": {"wieght": 1.0}}}, "unknown key mc.lens.wieght"),
        ({"mc": {"gist": 2}}, r"mc.gist in config must be a table"),
        ({"mc": {"lens": {"temperature": 0}}}, "mc.lens.temperature: must be > 0"),
        ({"mc": {"variants": 1, "alloc": {"variants": 2}}}, "mc.alloc.variants"),
    ],
)
def test_old_flat_mc_keys_name_their_new_home(sections, message):
    with pytest.raises(UserError, match=message):
        build_config(sections)


def test_an_old_key_on_the_command_line_names_its_new_home():
    with pytest.raises(UserError, match="mc.lens_every .* is now mc.lens.every"):
        resolve("cpu-tiny", [parse_override("mc.lens_every=2")])


def test_a_saved_config_loads_back_equal():
    from mcfn.profile import config_from_saved

    for overrides in ([], [parse_override("mc.lens.enabled=false"), parse_override("mc.gist.width=32")]):
        cfg = resolve("cpu-tiny", overrides)
        assert config_from_saved(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_checkpoint_config_from_before_the_split_still_loads():
    from mcfn.profile import config_from_saved

    saved = RunConfig().to_dict()
    flat_mc = {k: v for k, v in saved["mc"].items() if k not in ("gist", "lens", "alloc")}
    flat_mc |= {"gist_layers": 3, "lens": False, "lens_weight": 0.5, "alloc_noise": 2.0}
    cfg = config_from_saved({**saved, "mc": flat_mc})
    assert cfg.mc.gist.layers == 3 and not cfg.mc.lens.enabled and cfg.mc.lens.weight == 0.5
    assert cfg.mc.alloc.noise == 2.0


def test_a_checkpoint_config_from_before_a_key_reads_as_it_ran():
    """LensNet's granularity came with a new default ("block"); a checkpoint without the key ran "entry"."""
    from mcfn.profile import config_from_saved

    saved = RunConfig().to_dict()
    del saved["mc"]["lens"]["granularity"]
    assert config_from_saved(saved).mc.lens.granularity == "entry"
    assert RunConfig().mc.lens.granularity == "block"


def test_config_hash_follows_every_setting():
    base = resolve("cpu-tiny", [])
    assert base.digest() == resolve("cpu-tiny", []).digest()
    assert base.digest() != resolve("cpu-tiny", [parse_override("mc.lens.rank_margin=2")]).digest()
