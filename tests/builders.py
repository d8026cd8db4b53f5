"""What the tests build and check with: small systems and batches, Hypothesis strategies over tree shapes, the
cut checker, adversarial scores, generated documents and tiny profiles. One home, so that test files import from
here and never from each other or from ``conftest.py`` (which holds the fixtures)."""

from __future__ import annotations

import dataclasses
import json
import random
import tomllib
from pathlib import Path

import torch
from einops import rearrange
from hypothesis import strategies as st

from mcfn.config import MCConfig, ModelConfig
from mcfn.core.context import WorkingContext, assemble
from mcfn.core.model import GPT
from mcfn.core.nodes import NodeTable
from mcfn.core.outputs import StepOutput
from mcfn.core.preferences import lod_map
from mcfn.core.system import MegaContext, build_contexts, tree_stage
from mcfn.core.variants import coarsest_cut, draw_variant_noise
from mcfn.core.weights import LossWeights
from mcfn.geometry import coarsest_cover_size
from mcfn.profile import build_config
from train.run import main

VOCAB = 128
DIM = 32  # smeared_model's width


STEP_WEIGHTS = LossWeights.of(MCConfig(), torch.device("cpu"))


def flat(out: StepOutput) -> dict[str, torch.Tensor]:
    """Every tensor of a step's output under its name."""
    return {**out.losses, **out.metrics, **out.histograms}


def make_system(
    T: int,
    K: int,
    L: int,
    W: int,
    H: int,
    N: int,
    seed: int = 0,
    n_embd: int = 16,
    teacher: dict | None = None,
    lens: dict | None = None,
    gist: dict | None = None,
    refocus_every: int = 16,
    key_smear: bool = False,
) -> MegaContext:
    cfg = build_config(
        {
            # GistNet and LensNet: half of it wide
            "model": {"n_layer": 1, "n_head": 2, "n_embd": n_embd, "key_smear": key_smear},
            "data": {"seq_len": T},
            "mc": {
                "block_size": K,
                "lod_max": L,
                "budget": W,
                "tail": H,
                "variants": N,
                "refocus_every": refocus_every,
                "gist": gist or {},
                "lens": lens or {},
                "teacher": teacher or {},
            },
        }
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    torch.manual_seed(seed)
    system = MegaContext(cfg)
    with torch.no_grad():  # a GistNet that does more than average its children
        torch.nn.init.normal_(system.gistnet.out_proj.weight, std=0.5)
    return system


def spread_lens(system: MegaContext, seed: int) -> MegaContext:
    """A LensNet with large random matrices: its scores spread, so that what it reads decides the cut (a test of
    what it must not read then fails when it does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in system.lensnet.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=1.0, generator=g)
    return system


def rewritten_after(window: torch.Tensor, horizon: torch.Tensor, seed: int) -> torch.Tensor:
    """``window [B, T+1]`` with every token after ``horizon [B]`` replaced by a random one: what a cut chosen at
    the horizon must not see (I11)."""
    noise = torch.randint(0, VOCAB, window.shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(torch.arange(window.size(1))[None] > horizon[:, None], noise, window)


def decisive(system: MegaContext) -> MegaContext:
    """A random system whose predictions depend strongly on its context, with logits far apart (greedy
    choices and loss gaps then do not hinge on rounding)."""
    with torch.no_grad():
        torch.nn.init.normal_(system.base.lm_head.weight, std=2.0)
        for block in system.base.blocks:
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.3)
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.3)
            if block.attn.key_mix is not None:  # heads that smear by different amounts
                torch.nn.init.normal_(block.attn.key_mix, std=1.0)
    return system.eval()


@st.composite
def layouts(draw) -> dict:
    """Tree shapes from K=2 to the default K=16, with the edges drawn on purpose: the smallest budget (the
    coarsest cover), the largest (W = T) and the longest tail (H = T - K)."""
    K = draw(st.sampled_from([2, 3, 4, 8, 16]))
    L = draw(st.integers(1, {2: 3, 3: 2, 4: 2, 8: 2, 16: 2}[K]))
    T = K**L * draw(st.integers(1, 3 if K**L <= 64 else 1))
    while T < max(8, 2 * K):  # the smallest T a config accepts, and room for a tail of at least K before it
        T *= 2
    H = K * draw(st.one_of(st.just(T // K - 1), st.integers(1, T // K - 1)))
    low = max(H, coarsest_cover_size(T, K, L, H))
    W = draw(st.one_of(st.just(low), st.just(T), st.integers(low, T)))
    N = draw(st.integers(1, 3))
    return {"T": T, "K": K, "L": L, "W": W, "H": H, "N": N}


cases = st.tuples(layouts(), st.integers(1, 2), st.integers(0, 2**16))


def contexts(
    shape: dict, batch: int, seed: int, lens: dict | None = None
) -> tuple[MegaContext, torch.Tensor, WorkingContext]:
    system = make_system(**shape, seed=seed, lens=lens)
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (batch, shape["T"] + 1), generator=g)
    noise = draw_variant_noise(system.layout, batch, g, torch.device("cpu"))
    with torch.no_grad():
        return system, window, build_contexts(system, window, noise)[0]


def random_batches(system: MegaContext, n: int, batch: int = 2, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        window = torch.randint(0, vocab, (batch, system.layout.T + 1), generator=g)
        yield window, draw_variant_noise(system.layout, batch, g, torch.device("cpu"))


def token_coverage(shown: torch.Tensor, layout) -> torch.Tensor:
    """``[..., T]``: how many shown nodes cover each token."""
    coverage = torch.zeros(*shown.shape[:-1], layout.T, dtype=torch.int64)
    for k in range(layout.L + 1):
        lo = layout.level_offsets[k]
        coverage += shown[..., lo : lo + layout.level_sizes[k]].repeat_interleave(layout.K**k, dim=-1)
    return coverage


def check_cut(shown: torch.Tensor, layout) -> None:
    """A valid working context (I2): text covered at most once; what is left out is a union of whole spans of
    droppable gists (eligible, at LODmax), so each aligned top-level block of ``K^L`` tokens is covered whole or
    left out whole, and only an eligible one is
    left out; the tail at LOD0; within W."""
    coverage = token_coverage(shown, layout)
    assert (coverage <= 1).all(), "disjoint spans (I2)"
    unit = layout.K**layout.L
    blocks = rearrange(coverage, "... (n s) -> ... n s", s=unit)
    assert ((blocks == 1).all(-1) | (blocks == 0).all(-1)).all(), "text is left out in whole droppable spans (I2)"
    may_leave_out = torch.arange(layout.T // unit) < layout.eligible_counts[layout.L]
    assert ((blocks == 1).all(-1) | may_leave_out).all(), "only an eligible gist's span is left out (I2)"
    assert (lod_map(shown[:, None], NodeTable.of(layout))[..., layout.T - layout.H :] == 0).all(), "tail at LOD0 (I4)"
    assert (shown.sum(-1) <= layout.W).all(), "capacity (I3)"
    eligible = NodeTable.of(layout).eligible
    assert not (shown & ~eligible).any(), "no gist over the tail"


adversarial = st.sampled_from(["normal", "huge", "tiny", "equal", "negative", "positive"])


def adversarial_scores(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return {
        "normal": x,
        "huge": x * 1e6,
        "tiny": x * 1e-6,
        "equal": torch.ones(shape),
        "negative": -x.abs() - 1,
        "positive": x.abs() + 1,
    }[kind]


def expanded(cut: torch.Tensor, node: int, nodes: NodeTable) -> torch.Tensor:
    """``cut [..., n_nodes]`` with the shown gist ``node`` replaced by its children."""
    out = cut.clone()
    out[..., node] = False
    return out | (nodes.parent == node)


def awake(system: MegaContext) -> MegaContext:
    """Output projections start at zero, so a new model's attention changes nothing: wake them up, so that
    what an entry attends to (padding, positions, spans) shows in the outputs."""
    with torch.no_grad():
        for name, p in system.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, std=0.3)
    return system


def padded_contexts(system: MegaContext, window: torch.Tensor) -> WorkingContext:
    """Every sample's coarsest cut in rows of T slots: mostly padding."""
    nodes = system.nodes.with_sizes(W=system.layout.T)
    cut = coarsest_cut(system.layout, torch.device("cpu"))[None, None].expand(window.size(0), 1, -1)
    with torch.no_grad():
        return assemble(tree_stage(system, window), cut, window, nodes)


def random_batch(system, seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (b, system.layout.T + 1), generator=g)
    return window, draw_variant_noise(system.layout, b, g, torch.device("cpu"))


def one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ")
    return err[-1]


WORDS = (
    "the cat sat on a mat while dogs ran past old trees near quiet rivers and green hills under "
    "bright skies so every small bird sang songs of morning light to sleepy foxes"
).split()


def make_document(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def make_documents(n: int, seed: int = 0, sentences: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [make_document(rng, sentences) for _ in range(n)]


TINY_VOCAB = 320  # the tiny profile's model vocabulary: its 320 BPE tokens, a multiple of 64


def tiny_profile_system() -> tuple[MegaContext, int]:
    """The system of the tiny profile's runs and its batch size. Tests that compile the MC step with inductor use
    it, at that batch: inductor's cache then serves every such compile after the first in a test session (the
    compile-cache run's too), where each shape of its own cost a minute and a half on 2 cores."""
    cfg = build_config(tiny_sections("stdlib"))
    torch.manual_seed(0)
    system = MegaContext(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=TINY_VOCAB)))
    return system, cfg.train.batch_size


def tiny_sections(source: str, **extra: dict) -> dict[str, dict]:
    """Config sections for a model and corpus small enough for a test to train in seconds."""
    sections = {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32},
        "data": {"source": source, "seq_len": 32, "vocab_size": 320, "min_doc_chars": 100, "val_fraction": 0.2},
        "optim": {},
        "train": {
            "steps": 20,
            "batch_size": 4,
            "eval_every": 10,
            "eval_batches": 2,
            "log_every": 1,
            "wandb": "disabled",
        },
        "mc": {"block_size": 4, "lod_max": 2, "budget": 16, "tail": 8, "variants": 2, "refocus_every": 2},
    }
    for section, values in extra.items():
        sections[section].update(values)
    return sections


def toml_tables(name: str, values: dict) -> list[str]:
    """``[name]`` with its plain keys, then its nested tables (``[mc.lens]``) the same way."""
    lines = [f"[{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict)]
    for key, table in values.items():
        if isinstance(table, dict):
            lines += toml_tables(f"{name}.{key}", table)
    return lines


def write_profile(path: Path, sections: dict) -> Path:
    lines = [line for section, values in sections.items() for line in toml_tables(section, values)]
    path.write_text("\n".join(lines) + "\n")
    tomllib.loads(path.read_text())
    return path


def smeared_model(seed: int, n_layer: int = 2) -> GPT:
    """A GPT with the key smear whose heads smear by different amounts and whose blocks act (output projections
    start at zero)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=n_layer, n_head=2, n_embd=DIM, vocab_size=VOCAB, key_smear=True))
    with torch.no_grad():
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.key_mix, std=1.0)
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.3)
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.3)
    return model.eval()


def as_entries(starts: list[int], spans: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (the span's centre) and spans ``[1, n]``, as a working context carries them."""
    start, span = torch.tensor([starts], dtype=torch.float32), torch.tensor([spans], dtype=torch.float32)
    return start + (span - 1) / 2, span
