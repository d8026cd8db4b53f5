"""Run configuration: frozen dataclasses, one per section, each validating its own values.

Sections: ``model``, ``data``, ``optim``, ``train``, ``mc`` (with nested ``gist``, ``lens``, ``alloc`` and
``teacher`` tables) and ``lens_stage``: LensNet's two objectives side by side, the MC phase's (``mc.lens``) and the
stage's. Where a run executes and how it is watched (its device, a CUDA memory snapshot) are flags of ``train.run``,
not config: they do not change what it computes. An out-of-range value raises a one-line
:class:`~mcfn.errors.UserError` naming its dotted key (``mc.lens.attention_weight``). Reading profiles and overrides
into a config is :mod:`mcfn.profile`'s job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from mcfn.errors import UserError
from mcfn.geometry import coarsest_cover_size


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise UserError(f"invalid value for {key}: {why}")


AUX_LAYERS = 2  # GistNet's and LensNet's transformer layers (their width and heads: RunConfig.aux_*)


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 128
    # Smeared keys: each head's key mixes in the previous token's where both are adjacent raw tokens (I13); retrieval
    # then forms earlier in the plain phase (LABLOG, twentieth session).
    key_smear: bool = False
    # Set from the trained tokenizer at run time (padded to a multiple of 64), never from a profile.
    vocab_size: int = field(default=0, metadata={"derived": True})

    def __post_init__(self) -> None:
        _require(self.n_layer >= 1, "model.n_layer", "must be >= 1")
        _require(self.n_head >= 1, "model.n_head", "must be >= 1")
        _require(self.n_embd % self.n_head == 0, "model.n_embd", "must be a multiple of model.n_head")
        _require((self.n_embd // self.n_head) % 2 == 0, "model.n_embd", "head width must be even (rotary)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # stdlib | text:DIR | jsonl:PATH | parquet:PATH | a path (kind guessed)
    seq_len: int = 1024  # T: tokens per training sample
    vocab_size: int = 4096  # BPE vocabulary requested from the tokenizer trainer
    min_doc_chars: int = 512  # shorter documents are skipped
    val_fraction: float = 0.05  # share of documents (by path hash) held out for validation and design choices
    test_fraction: float = 0.1  # share held out for the final evaluation alone (train.eval --split test)
    # Share of training windows rewritten by the long-range generators (facts written into the real text, the
    # question at the end, in the scored tail), drawn on a stream of their own; 0: natural text only.
    mix: float = 0.0
    # The share in a MegaContext run's MC phase (after train.plain_steps), where LensNet learns what text reads far
    # back; -1: data.mix throughout.
    mc_mix: float = -1.0
    mix_tasks: str = "passkey,kv-recall"  # comma-separated: which generators share the mixed windows

    def __post_init__(self) -> None:
        _require(bool(self.source.strip()), "data.source", "must not be empty")
        _require(self.seq_len >= 8, "data.seq_len", "must be >= 8")
        _require(257 <= self.vocab_size <= 65536, "data.vocab_size", "must be in [257, 65536]")
        _require(self.min_doc_chars >= 0, "data.min_doc_chars", "must be >= 0")
        _require(0.0 < self.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
        _require(
            0.0 <= self.test_fraction < 1.0 - self.val_fraction,
            "data.test_fraction",
            "must be >= 0 and leave documents for training beside data.val_fraction",
        )
        _require(0.0 <= self.mix <= 1.0, "data.mix", "must lie in [0, 1]")
        _require(self.mc_mix == -1.0 or 0.0 <= self.mc_mix <= 1.0, "data.mc_mix", "must lie in [0, 1], or be -1")
        _require(bool(self.mix_task_names), "data.mix_tasks", "must name at least one task")

    @property
    def mix_task_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.mix_tasks.split(",") if name.strip())


@dataclass(frozen=True)
class OptimConfig:
    embedding_lr: float = 0.3  # AdamW, token embedding
    unembedding_lr: float = 0.008  # AdamW, output head
    warmdown_frac: float = 0.3  # share of steps at the end with a linear decay (to 5 % of the rate)

    def __post_init__(self) -> None:
        for name in ("embedding_lr", "unembedding_lr"):
            _require(getattr(self, name) > 0, f"optim.{name}", "must be > 0")
        _require(0 <= self.warmdown_frac <= 1, "optim.warmdown_frac", "must be in [0, 1]")


@dataclass(frozen=True)
class GistConfig:
    # Weight of loss_recon: every gist read back into the tokens it covers by a small decoder (0: off). It reads
    # at most RECON_TOKENS tokens a level and sequence (mcfn.core.reconstruction), so its cost stops growing with T.
    recon_weight: float = 0.0
    # Blocks per level and sequence through which GistNet's gradient flows (0: every block, the exact backward).
    # The tree's values are computed without a gradient and GistNet reruns with one on the blocks the working
    # contexts read first (mcfn.core.tree), so its backward stops growing with T. Off by default.
    grad_blocks: int = 0

    def __post_init__(self) -> None:
        _require(self.recon_weight >= 0, "mc.gist.recon_weight", "must be >= 0")
        _require(self.grad_blocks >= 0, "mc.gist.grad_blocks", "must be >= 0 (0: every block)")


MATCH_PRIORS = ("", "sum", "gated")


@dataclass(frozen=True)
class LensConfig:
    enabled: bool = True  # LensNet, its preference loss and the allocator-built variant
    # Auxiliary target: rank entries by the tail's attention mass in the full-window teacher's forward
    # (mcfn.core.attention); needs [mc.teacher].
    attention_weight: float = 0.0
    # LensNet's score is the match's own (its copy votes and recency prior, mcfn.core.match) plus what LensNet
    # learns: "sum", all of it (a new LensNet's head starts at zero, so it cuts as the match does); "gated", only
    # where it stands out (mcfn.core.lensnet.standing_out), so that on text it cuts as the match does. "": no prior.
    # The LensNet stage sets it; a checkpoint saved when it was a boolean reads true as "sum".
    match_prior: str = ""
    # The query-aware indexer (mcfn.core.lensnet): LensNet also reads what the base model is about to ask (its hidden
    # states over the newest tokens before the horizon) and match's votes for n = 2, 3 and 4 on each unit, and adds a
    # lightning-indexer term (ReLU of query-key products, weighted per head by the query); every cut it chooses keeps
    # (W - H) / 2 tokens before the horizon at LOD0. Needs a match prior, so that a new LensNet cuts as match does.
    indexer: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.match_prior, bool):  # a checkpoint saved before the gated prior existed
            object.__setattr__(self, "match_prior", "sum" if self.match_prior else "")
        _require(self.attention_weight >= 0, "mc.lens.attention_weight", "must be >= 0")
        _require(self.match_prior in MATCH_PRIORS, "mc.lens.match_prior", f"must be one of {MATCH_PRIORS}")
        _require(not self.indexer or bool(self.match_prior), "mc.lens.indexer", "needs mc.lens.match_prior")


@dataclass(frozen=True)
class AllocConfig:
    """The allocator-built variant: with LensNet, the last of the N compressed variants is the allocator's cut from
    LensNet's scores, so that LensNet learns on the contexts it creates; the rest are random."""

    iterations: int = 1  # allocator steps for that variant, each with its own exploration noise
    noise: float = 1.0  # std of the exploration noise added to LensNet's scores for it

    def __post_init__(self) -> None:
        _require(self.iterations >= 1, "mc.alloc.iterations", "must be >= 1")
        _require(self.noise >= 0, "mc.alloc.noise", "must be >= 0")


@dataclass(frozen=True)
class TeacherConfig:
    """The full-window teacher (:mod:`mcfn.core.teacher`): one extra base forward over the window's tokens."""

    full_weight: float = 0.0  # next-token loss over the whole window at LOD0 (keeps ``full`` an upper bound)
    # A bound on its cost: every token reads only the `window` tokens up to itself, and the tail reads them all: the
    # teacher's cost grows like T·window + H·T instead of T². 0: full attention.
    window: int = 0

    def __post_init__(self) -> None:
        _require(self.full_weight >= 0, "mc.teacher.full_weight", "must be >= 0")
        _require(self.window >= 0, "mc.teacher.window", "must be >= 0 (0: full attention)")

    @property
    def enabled(self) -> bool:
        return self.full_weight > 0


@dataclass(frozen=True)
class MCConfig:
    enabled: bool = True  # MegaContext training; --no-mc trains the plain GPT on the same data
    block_size: int = 16  # K: children per gist
    lod_max: int = 2  # highest level of detail in the tree
    budget: int = 256  # W: working-context capacity in entries
    tail: int = 64  # H: the last H tokens, LOD0 in every variant and scored in every variant
    variants: int = 2  # N: compressed variants per sample (V = 1 + N with the recency baseline)
    # Priority sampling: the share of the random compressed variants that expand first the blocks match's copy votes
    # fall on, where detail is likely to move the tail's loss (0: every random variant uniform, as before).
    voted_share: float = 0.0
    # R: tokens read between two refocuses. Generation refocuses every R tokens within W - R entries, and the
    # evaluation scores what generation computes: every condition that chooses a cut refocuses every R tail tokens.
    refocus_every: int = 16
    # The most refocuses per token a shipped refocus rule may make (the ship choice refuses the rest): the decode cost
    # a rule that refocuses on events may buy (mcfn.core.cadence).
    refocus_cap: float = 0.1
    gist: GistConfig = field(default_factory=GistConfig)  # [mc.gist]
    lens: LensConfig = field(default_factory=LensConfig)  # [mc.lens]
    alloc: AllocConfig = field(default_factory=AllocConfig)  # [mc.alloc]
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # [mc.teacher]

    def __post_init__(self) -> None:
        _require(self.block_size >= 2, "mc.block_size", "must be >= 2")
        _require(self.lod_max >= 1, "mc.lod_max", "must be >= 1")
        _require(
            self.tail >= 1 and self.tail % self.block_size == 0,
            "mc.tail",
            "must be a positive multiple of mc.block_size",
        )
        _require(self.variants >= 1, "mc.variants", "must be >= 1")
        _require(0 <= self.voted_share <= 1, "mc.voted_share", "must be in [0, 1]")
        # Its upper bound (mcfn.geometry.most_refocus_every) binds only where a cut is refocused: generation
        # and the evaluation.
        _require(self.refocus_every >= 1, "mc.refocus_every", "must be >= 1")
        _require(self.refocus_cap > 0, "mc.refocus_cap", "must be > 0")
        _require(
            self.lens.attention_weight == 0 or self.teacher.enabled,
            "mc.lens.attention_weight",
            "needs the full-window teacher: set mc.teacher.full_weight > 0",
        )

    @property
    def alloc_variants(self) -> int:
        """Allocator-built variants per sample: one with LensNet, none without."""
        return int(self.lens.enabled)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 4  # B: samples per step (the global batch, whatever the number of processes)
    # Rows per forward/backward, gradients accumulated over the rest; 0: the whole batch on CPU, the largest
    # that fits on a GPU (found by trying, halving on out-of-memory).
    micro_batch_size: int = 0
    # Validation bpb, sample 0's working contexts (printed and appended to lod_maps.txt), then a checkpoint, every
    # this many steps and at the end (at step 0 no checkpoint; the last maps are the last step's).
    eval_every: int = 50
    eval_batches: int = 8  # validation batches of batch_size windows each
    log_every: int = 1  # read the loss back and write metrics every this many steps
    seed: int = 1337
    compile: bool = False
    compile_mode: str = "max-autotune"
    wandb: str = "offline"
    # MC runs end with a brief evaluation on this many test batches (more than eval_batches: the differences are
    # small) and the report's opening lines; 0: none.
    final_eval_batches: int = 32
    # A run directory (or checkpoint) whose trained base model this run starts from (two-stage training); the
    # rest (GistNet, LensNet, optimizers, step) starts afresh. Empty: from scratch.
    init_from: str = ""
    # MegaContext runs: the first this many steps train the base model alone, as a plain GPT over whole windows
    # (a plain phase at length T, where it learns to read long contexts), then the MegaContext step takes over.
    plain_steps: int = 0

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "eval_every",
            "eval_batches",
            "log_every",
        ):
            _require(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        _require(self.final_eval_batches >= 0, "train.final_eval_batches", "must be >= 0 (0: no final evaluation)")
        _require(self.micro_batch_size >= 0, "train.micro_batch_size", "must be >= 0 (0: automatic)")
        _require(
            0 <= self.plain_steps < self.steps,
            "train.plain_steps",
            f"must lie in [0, train.steps = {self.steps}) (with --steps, also --set train.plain_steps=N)",
        )
        _require(self.compile_mode in COMPILE_MODES, "train.compile_mode", f"must be one of {COMPILE_MODES}")
        _require(self.wandb in WANDB_MODES, "train.wandb", f"must be one of {WANDB_MODES}")


@dataclass(frozen=True)
class LensStageConfig:
    """LensNet's second objective, the counterfactual stage (:mod:`mcfn.stage.rounds`, ``train.lens``), beside its
    first, the MC phase's ``[mc.lens]``: rounds of traces of fresh training windows, each edit of LensNet's cut
    labelled with its ΔNLL, and the ranking loss over them."""

    # Rounds at the end of a MegaContext run with LensNet, before its final evaluation (0: none; train.lens runs
    # the stage on a finished run, 3 rounds unless this or --rounds says otherwise).
    rounds: int = 0
    windows: int = 64  # fresh training windows traced per round
    held_out: int = 32  # validation windows each round's policy is measured on (the ship choice then reads its own)

    def __post_init__(self) -> None:
        _require(self.rounds >= 0, "lens_stage.rounds", "must be >= 0")
        for name in ("windows", "held_out"):
            _require(getattr(self, name) >= 1, f"lens_stage.{name}", "must be >= 1")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mc: MCConfig = field(default_factory=MCConfig)
    lens_stage: LensStageConfig = field(default_factory=LensStageConfig)

    def __post_init__(self) -> None:
        mc, seq_len = self.mc, self.data.seq_len
        if not mc.enabled:
            return
        top = mc.block_size**mc.lod_max
        _require(seq_len % top == 0, "data.seq_len", f"must be a multiple of mc.block_size**mc.lod_max = {top}")
        _require(mc.tail <= mc.budget <= seq_len, "mc.budget", "must lie between mc.tail and data.seq_len")
        need = coarsest_cover_size(seq_len, mc.block_size, mc.lod_max, mc.tail)
        _require(mc.budget >= need, "mc.budget", f"must be >= {need}, the coarsest working context that covers T")
        window = mc.teacher.window
        _require(window == 0 or seq_len % window == 0, "mc.teacher.window", "must be 0 or divide data.seq_len")
        width, heads = self.aux_width, self.aux_heads
        _require(
            width % heads == 0 and (width // heads) % 2 == 0,
            "model.n_embd",
            f"GistNet and LensNet split half of it, {width}, into {heads} heads: each must be of even width",
        )

    @property
    def aux_width(self) -> int:
        """GistNet's and LensNet's internal width: half the model's."""
        return self.model.n_embd // 2

    @property
    def aux_heads(self) -> int:
        """GistNet's and LensNet's heads: 64 wide where the width allows, at least two."""
        return max(2, self.aux_width // 64)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every setting under its dotted key (``mc.lens.attention_weight``)."""
        return flatten(self.to_dict())

    def digest(self) -> str:
        """A short hash of the resolved config: two runs with the same digest were configured alike."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def flatten(tables: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as one dict of dotted keys."""
    out: dict[str, Any] = {}
    for key, value in tables.items():
        dotted = f"{prefix}{key}"
        out.update(flatten(value, f"{dotted}.") if isinstance(value, dict) else {dotted: value})
    return out
