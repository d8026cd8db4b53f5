"""The needle grid (:mod:`mcfn.evaluation.needle`, ``train.needle``): prompts of exactly the asked length with the
fact at its depth, cells scored from what each policy's decode gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mcfn.data.corpus import Split
from mcfn.data.probes import PASSKEY_QUESTION
from mcfn.evaluation.needle import answered, needle_grid, needle_prompts
from mcfn.shell.run_report import NEEDLE_HEADING, with_needle_section


class DigitTokenizer:
    """Characters as token ids (the needle's text is ASCII), BOS 0."""

    bos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def stream(n: int = 5000) -> Split:
    tokens = np.random.default_rng(0).integers(200, 300, n).astype(np.uint16)  # no character of the fact
    return Split(tokens=tokens, doc_offsets=np.array([0, n]))


def test_a_needle_prompt_has_its_length_the_fact_at_its_depth_and_the_question_last():
    tok = DigitTokenizer()
    prompts = needle_prompts(stream(), tok, 400, (0.1, 0.5, 0.9), 3, seed=1, device=torch.device("cpu"))
    assert len(prompts) == 9
    question = tok.encode(PASSKEY_QUESTION)
    for p in prompts:
        ids = p.ids.tolist()
        assert len(ids) == p.length == 400 and ids[0] == tok.bos_id and ids[-len(question) :] == question
        key = "".join(chr(t) for t in p.answer.tolist()).strip()
        fact_at = "".join(chr(t) if t < 200 else "_" for t in ids).index(f"The pass key is {key}")
        haystack = [t >= 200 for t in ids]  # the held-out text's tokens, around the fact
        assert abs(sum(haystack[:fact_at]) / sum(haystack) - p.depth) < 0.01
    # one haystack and key per prompt index, shared by its depths
    first = [p for p in prompts[:3]]
    assert len({tuple(p.answer.tolist()) for p in first}) == 1


def key_reader(depths_read: set[float]):
    """A decode that answers with the prompt's key where the fact lies at one of ``depths_read`` (found in the
    prompt's text), and with a wrong key elsewhere: what the grid scores must be what it decodes."""

    def decode(prompt, n):
        text = "".join(chr(t) if t < 200 else "_" for t in prompt.tolist())
        at = text.index("The pass key is ") + len("The pass key is ")
        key = " " + text[at : at + 5]
        depth = text[:at].count("_") / text.count("_")
        right = any(abs(depth - d) < 0.05 for d in depths_read)
        ids = [ord(c) for c in key] if right else [ord(c) for c in " 00000"]
        return torch.tensor(ids[:n])

    return decode


def test_the_grid_scores_each_cell_from_what_its_decode_gives():
    cells = needle_grid({"reads 10%": key_reader({0.1}), "reads none": key_reader(set())}, stream(), DigitTokenizer(),
                        lengths=(300, 600), depths=(0.1, 0.9), count=4)  # fmt: skip
    got = {(c.policy, c.length, c.depth): (c.correct, c.prompts) for c in cells}
    assert got == {
        ("reads 10%", 300, 0.1): (4, 4), ("reads 10%", 300, 0.9): (0, 4),
        ("reads 10%", 600, 0.1): (4, 4), ("reads 10%", 600, 0.9): (0, 4),
        ("reads none", 300, 0.1): (0, 4), ("reads none", 300, 0.9): (0, 4),
        ("reads none", 600, 0.1): (0, 4), ("reads none", 600, 0.9): (0, 4),
    }  # fmt: skip


def test_an_answer_counts_only_when_every_token_is_the_keys():
    key = torch.tensor([5, 6, 7])
    assert answered(torch.tensor([5, 6, 7]), key)
    assert not answered(torch.tensor([5, 6, 8]), key) and not answered(torch.tensor([5, 6]), key)


def test_a_prompt_longer_than_the_split_is_refused():
    with pytest.raises(Exception, match="needs"):
        needle_prompts(stream(100), DigitTokenizer(), 400, (0.5,), 1, seed=0, device=torch.device("cpu"))


def test_the_report_keeps_one_needle_section():
    report = "# Run report\n\n## Loss\n\nplot\n"
    once = with_needle_section(report, "grid A")
    twice = with_needle_section(once, "grid B")
    assert twice.count(NEEDLE_HEADING) == 1 and "grid B" in twice and "grid A" not in twice and "## Loss" in twice


@pytest.mark.heavy(25)
def test_needle_cli_grids_a_trained_run_with_what_generation_decodes(decoding_run, tmp_path, monkeypatch):
    """``train.needle`` on a tiny run: every (policy, length, depth) cell, and each cell's count is what
    ``generate_mc``/``generate_full`` decode on its prompts (their answers recorded as they are made)."""
    from mcfn.inference import generation
    from train.needle import main

    run, _ = decoding_run
    decoded: list[tuple[str, bool]] = []
    for name in ("generate_mc", "generate_full"):
        real = getattr(generation, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            decoded.append((_name, out))
            return out

        monkeypatch.setattr(generation, name, recording)
    code = main(["--ckpt", str(run), "--lengths", "120,240", "--depths", "0.2,0.8", "--prompts", "2",
                 "--split", "val", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "needle.json").read_text())
    cells = result["cells"]
    assert len(cells) == 2 * 2 * 2 and all(c["prompts"] == 2 for c in cells)
    assert len([d for d in decoded if d[0] == "generate_mc"]) == 8 and len(decoded) == 16
    assert (tmp_path / "needle.png").stat().st_size > 0 and "| tokens |" in (tmp_path / "needle.md").read_text()
