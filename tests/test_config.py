import dataclasses
import json
from pathlib import Path

import pytest

from mcfn.config import DataConfig, LensConfig, RunConfig
from mcfn.core.system import MegaContext
from mcfn.errors import UserError
from mcfn.profile import PROFILES_DIR, build_config, parse_override, resolve


def test_every_shipped_profile_resolves():
    names = sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
    assert {"default", "cpu-small", "gpu-h100"} <= set(names)
    for name in names:
        assert isinstance(resolve(name, []), RunConfig)


def test_overrides_apply_after_profile_in_order():
    cfg = resolve(
        "cpu-long",
        [
            parse_override("train.steps=7"),
            parse_override("train.steps=9"),
            parse_override("data.source=text:/somewhere"),
            parse_override("optim.embedding_lr=1"),
        ],
    )
    assert cfg.train.steps == 9
    assert cfg.data.source == "text:/somewhere"
    assert cfg.optim.embedding_lr == 1.0 and isinstance(cfg.optim.embedding_lr, float)


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
        ({"optim": {"warmdown_frac": 1.5}}, "optim.warmdown_frac"),
        ({"train": {"steps": 10, "plain_steps": 10}}, "train.plain_steps: .* also --set train.plain_steps=N"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(sections, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_config(sections)


def test_unknown_profile_lists_known_ones():
    with pytest.raises(UserError, match="known: .*default"):
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
    cfg = resolve("cpu-long", [parse_override("mc.gist.recon_weight=2"), parse_override("mc.alloc.noise=0.5")])
    assert cfg.mc.gist.recon_weight == 2.0 and cfg.mc.alloc.noise == 0.5
    assert cfg.flat()["mc.gist.recon_weight"] == 2.0
    off = build_config({"mc": {"lens": {"enabled": False}}})
    assert not off.mc.lens.enabled and off.mc.alloc_variants == 0


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"mc": {"lens_weight": 2.0}}, "unknown key mc.lens_weight"),
        ({"mc": {"lens": {"rank": True}}}, "unknown key mc.lens.rank"),
        ({"mc": {"variant_spend_min": 0.5}}, "unknown key mc.variant_spend_min"),
        ({"mc": {"lens": False}}, "mc.lens in config must be a table"),
        ({"mc": {"lens": {"wieght": 1.0}}}, "unknown key mc.lens.wieght"),
        ({"mc": {"gist": 2}}, r"mc.gist in config must be a table"),
        ({"mc": {"lens": {"attention_weight": -1}}}, "mc.lens.attention_weight: must be >= 0"),
        ({"mc": {"lens": {"temperature": 0.5}}}, "unknown key mc.lens.temperature"),
        ({"mc": {"alloc": {"variants": 2}}}, "unknown key mc.alloc.variants"),
    ],
)
def test_a_bad_mc_table_is_refused_naming_its_key(sections, message):
    with pytest.raises(UserError, match=message):
        build_config(sections)


def test_a_saved_config_loads_back_equal():
    from mcfn.profile import config_from_saved

    for overrides in ([], [parse_override("mc.lens.enabled=false"), parse_override("mc.gist.recon_weight=0.5")]):
        cfg = resolve("cpu-long", overrides)
        assert config_from_saved(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_config_saved_with_a_retired_knob_loads_at_its_fixed_value_and_is_refused_at_another():
    """Runs trained before a knob went still load (their value is the one the code now fixes); a run trained with
    another value cannot be honoured and is refused, naming the knob. Fails with the retired keys not dropped."""
    from mcfn.profile import config_from_saved

    cfg = resolve("cpu-long", [])
    saved = json.loads(json.dumps(cfg.to_dict()))
    saved["model"]["softcap"] = 15.0
    saved["mc"]["lens"]["temperature"] = 0.5
    saved["train"]["wandb_project"] = "anything"
    saved["train"].update(ckpt_every=123, lod_map_every=0, final_eval=False)  # where files went and what was shown
    saved["optim"]["grad_clip"] = 1.0
    assert config_from_saved(saved) == cfg
    saved["mc"]["lens"]["temperature"] = 2.0
    with pytest.raises(UserError, match="mc.lens.temperature=2.0"):
        config_from_saved(saved)


# Every retired knob whose value the code now fixes, with that value and another one, written out by hand: the test
# does not read the values from RETIRED, so a knob made to accept any value there is caught.
FIXED_KNOBS = {
    "model.softcap": (15.0, 20.0),
    "model.rope_base": (10000.0, 500.0),
    "optim.gain_lr": (0.02, 0.1),
    "optim.weight_decay": (0.0, 0.1),
    "optim.adam_beta1": (0.8, 0.9),
    "optim.adam_beta2": (0.95, 0.99),
    "optim.warmup_frac": (0.0, 0.1),
    "optim.final_lr_frac": (0.05, 0.0),
    "optim.grad_clip": (1.0, 0.5),
    "mc.gist.kind": ("gistnet", "mean"),
    "mc.gist.source": ("embedding", "hidden"),
    "mc.gist.layers": (2, 3),
    "mc.gist.width": (0, 32),
    "mc.gist.heads": (2, 4),
    "mc.gist.recon_tokens": (512, 0),
    "mc.lens.weight": (1.0, 0.5),
    "mc.lens.pref_weight": (1.0, 2.0),
    "mc.lens.budget_weight": (0.1, 0.0),
    "mc.lens.temperature": (0.5, 2.0),
    "mc.lens.every": (1, 2),
    "mc.lens.match_feature": (False, True),
    "mc.lens.horizons": ("tail", "chunks"),
    "mc.lens.pair_weight": (0.0, 1.0),
    "mc.lens.cadence": (False, True),
    "mc.lens.layers": (2, 3),
    "mc.lens.width": (0, 32),
    "mc.lens.heads": (2, 4),
    "mc.teacher.stretch": (0, 256),
    "mc.leave_out": ("top", "gist"),
    "mc.alloc.variants": (1, 2),
    "optim.matrix_lr": (0.02, 0.03),
    "data.tokenizer_train_chars": (20_000_000, 2_000_000),
    "train.activation_checkpointing": (False, True),
    "model.smear": (False, True),
    "model.mimetic": (False, True),
    "model.gain_init": (1.0, 3.0),
    "lens_stage.states_per_batch": (16, 8),
    "lens_stage.random_cuts": (2, 0),
}


def test_the_retired_knobs_that_fix_a_value_are_the_ones_listed_here():
    from mcfn.profile import ANY_VALUE, RETIRED

    assert {name for name, value in RETIRED.items() if value is not ANY_VALUE} == set(FIXED_KNOBS)


def test_a_run_saved_with_train_lens_rounds_loads_it_as_lens_stage_rounds():
    """``train.lens_rounds`` moved into ``[lens_stage]``: a run saved before (without the section) reads it there,
    with the section's other settings at their defaults; the runtime settings that left the config load at any
    value."""
    from mcfn.config import LensStageConfig
    from mcfn.profile import config_from_saved

    cfg = resolve("cpu-longrange", [])
    saved = json.loads(json.dumps(cfg.to_dict()))
    del saved["lens_stage"]
    saved["train"] |= {"lens_rounds": 3, "device": "cuda:1", "memory_snapshot": "mem.pickle"}
    assert config_from_saved(saved) == cfg and cfg.lens_stage == LensStageConfig(rounds=3)


def test_the_stages_settings_are_reached_by_set_and_checked():
    cfg = resolve("default", [parse_override("lens_stage.windows=8"), parse_override("lens_stage.held_out=4")])
    assert (cfg.lens_stage.windows, cfg.lens_stage.held_out) == (8, 4)
    with pytest.raises(UserError, match="lens_stage.windows"):
        resolve("default", [parse_override("lens_stage.windows=0")])


@pytest.mark.parametrize("name", list(FIXED_KNOBS))
def test_a_retired_knob_loads_at_its_fixed_value_and_is_refused_at_another(name):
    """The knobs whose A/B lost, and those nothing set, are gone; a run saved at the value the code fixes loads, one
    saved at another value is refused in one line naming it."""
    from mcfn.profile import config_from_saved

    fixed, other = FIXED_KNOBS[name]
    cfg = resolve("cpu-long", [])
    saved = json.loads(json.dumps(cfg.to_dict()))
    *path, key = name.split(".")
    table = saved
    for part in path:
        table = table[part]
    table[key] = fixed
    assert config_from_saved(saved) == cfg
    table[key] = other
    with pytest.raises(UserError, match=f"{name}={other!r}") as refused:
        config_from_saved(saved)
    assert "\n" not in str(refused.value)


def test_a_config_saved_before_test_splits_existed_loads_without_one_and_finds_its_old_cache():
    """A run saved before ``data.test_fraction`` existed trained on every non-validation document: it loads with no
    test split, and a corpus key of its own (test_fraction enters the key only where it is not 0, so the key is the
    one such a run was saved with)."""
    from mcfn.data.corpus import corpus_key
    from mcfn.data.sources import open_source
    from mcfn.profile import config_from_saved

    saved = json.loads(json.dumps(resolve("cpu-long", []).to_dict()))
    del saved["data"]["test_fraction"]
    old = config_from_saved(saved)
    assert old.data.test_fraction == 0.0 and resolve("cpu-long", []).data.test_fraction > 0
    source = open_source(old.data.source)
    assert corpus_key(source, old.data) != corpus_key(source, resolve("cpu-long", []).data)


def test_a_profile_extends_another_and_says_only_what_differs(tmp_path):
    (tmp_path / "base.toml").write_text("[train]\nsteps = 7\nbatch_size = 2\n[mc.gist]\nrecon_weight = 0.5\n")
    (tmp_path / "child.toml").write_text(
        'extends = "base.toml"\n[train]\nsteps = 9\n[mc.lens]\nattention_weight = 3\n[mc.teacher]\nfull_weight = 1\n'
    )
    cfg = resolve(str(tmp_path / "child.toml"), [])
    assert (cfg.train.steps, cfg.train.batch_size) == (9, 2)
    assert (cfg.mc.gist.recon_weight, cfg.mc.lens.attention_weight) == (0.5, 3)
    (tmp_path / "loop.toml").write_text('extends = "loop.toml"\n')
    with pytest.raises(UserError, match="extends itself"):
        resolve(str(tmp_path / "loop.toml"), [])


def test_the_shipped_profiles_that_extend_differ_from_their_parent_in_a_few_keys():
    """cpu-longrange is the default trained longer, with the LensNet stage; gpu-h200 is gpu-h100 over twice the
    history."""
    longrange, default = resolve("cpu-longrange", []), resolve("default", [])
    assert longrange.model == default.model and longrange.mc == default.mc and longrange.data.seq_len == 512
    assert longrange.train.plain_steps > default.train.plain_steps and longrange.lens_stage.rounds > 0
    h200, h100 = resolve("gpu-h200", []), resolve("gpu-h100", [])
    assert h200.model == h100.model and h200.data.seq_len == 2 * h100.data.seq_len


def test_config_hash_follows_every_setting():
    base = resolve("cpu-long", [])
    assert base.digest() == resolve("cpu-long", []).digest()
    assert base.digest() != resolve("cpu-long", [parse_override("mc.gist.recon_weight=2")]).digest()


@pytest.mark.parametrize(("n_embd", "n_head", "heads"), [(32, 2, 2), (128, 2, 2), (256, 4, 2), (768, 6, 6)])
def test_gistnet_and_lensnet_run_at_half_the_models_width_in_heads_of_64_at_least_two(n_embd, n_head, heads):
    """Their shape follows the model's: the widths of 64 and 128 keep the two heads every CPU profile trained with,
    and the GPU profile's 768 gets the 6 heads it set by hand before."""
    cfg = build_config({"model": {"n_embd": n_embd, "n_head": n_head}})
    assert (cfg.aux_width, cfg.aux_heads) == (n_embd // 2, heads)
    system = MegaContext(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64)))
    assert system.gistnet.blocks[0].attn.n_head == heads and system.lensnet.blocks[0].attn.n_head == heads


def test_a_model_width_gistnet_and_lensnet_cannot_split_is_refused_naming_it():
    with pytest.raises(UserError, match="model.n_embd: GistNet and LensNet split half of it, 450, into 7 heads"):
        build_config({"model": {"n_embd": 900, "n_head": 6}})


def test_a_run_saved_with_a_boolean_match_prior_reads_it_as_the_sum_and_a_profile_names_one():
    """``mc.lens.match_prior`` was a boolean: a checkpoint saved with ``true`` meant the ungated sum and still does;
    a profile names "", "sum" or "gated", and nothing else."""
    from mcfn.profile import config_from_saved

    saved = json.loads(json.dumps(resolve("default", []).to_dict()))
    for old, new in ((True, "sum"), (False, "")):
        saved["mc"]["lens"]["match_prior"] = old
        assert config_from_saved(saved).mc.lens.match_prior == new
    assert resolve("default", [parse_override('mc.lens.match_prior="gated"')]).mc.lens.match_prior == "gated"
    with pytest.raises(UserError, match="mc.lens.match_prior"):
        resolve("default", [parse_override('mc.lens.match_prior="always"')])


def test_the_indexer_needs_a_match_prior_and_the_mc_mix_a_share():
    assert LensConfig(match_prior="sum", indexer=True).indexer
    with pytest.raises(UserError, match="mc.lens.indexer"):
        LensConfig(indexer=True)
    assert DataConfig(mc_mix=0.5).mc_mix == 0.5 and DataConfig().mc_mix == -1.0
    with pytest.raises(UserError, match="data.mc_mix"):
        DataConfig(mc_mix=1.5)
