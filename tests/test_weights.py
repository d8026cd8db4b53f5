"""``LossWeights``: every loss-weight setting lands on its own 0-d tensor."""

from __future__ import annotations

import pytest
import torch

from mcfn.config import GistConfig, LensConfig, MCConfig, TeacherConfig
from mcfn.core.weights import BUDGET_WEIGHT, PREF_WEIGHT, TEMPERATURE, LossWeights


def test_lens_weights_map_each_setting_to_its_term():
    lens = LensConfig(attention_weight=17.0)
    teacher = TeacherConfig(full_weight=19.0)
    mc = MCConfig(lens=lens, teacher=teacher, gist=GistConfig(recon_weight=29.0))
    weights = LossWeights.of(mc, torch.device("cpu"))
    expected = {
        "pref": PREF_WEIGHT,
        "budget": BUDGET_WEIGHT,
        "temperature": TEMPERATURE,
        "attention": 17.0,
        "full": 19.0,
        "recon": 29.0,
    }
    assert weights.values() == pytest.approx(expected)
    assert all(getattr(weights, name).ndim == 0 for name in expected)
