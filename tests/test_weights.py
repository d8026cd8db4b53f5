"""``LossWeights``: every loss-weight setting lands on its own 0-d tensor."""

from __future__ import annotations

import torch

from mcfn.config import GistConfig, LensConfig, MCConfig, TeacherConfig
from mcfn.core.weights import LossWeights


def test_lens_weights_map_each_setting_to_its_term():
    lens = LensConfig(
        weight=2.0,
        pref_weight=3.0,
        budget_weight=5.0,
        pair_weight=7.0,
        temperature=13.0,
        attention_weight=17.0,
    )
    teacher = TeacherConfig(full_weight=19.0)
    mc = MCConfig(lens=lens, teacher=teacher, gist=GistConfig(recon_weight=29.0))
    weights = LossWeights.of(mc, torch.device("cpu"))
    expected = {
        "lens": 2.0,
        "pref": 3.0,
        "budget": 5.0,
        "pair": 7.0,
        "temperature": 13.0,
        "attention": 17.0,
        "full": 19.0,
        "recon": 29.0,
    }
    assert weights.values() == expected
    assert all(getattr(weights, name).ndim == 0 for name in expected)
