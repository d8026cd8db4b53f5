"""Every loss weight of the MegaContext step in one typed, frozen container.

Each weight is a 0-d tensor on the step's device: the compiled step reads it as an input, so changing a
value (in place, ``weights.recon.fill_(0.1)``) never recompiles, and a field that does not exist is an
``AttributeError`` where it is read, not a missing string key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from mcfn.config import MCConfig

# LensNet's loss: the entry-wise preference term at weight 1 and the budget term at 0.1; a pair of variants weighs
# tanh(|ΔNLL| / 0.5 nats). Fixed values (tests switch terms off through the fields below).
PREF_WEIGHT, BUDGET_WEIGHT, TEMPERATURE = 1.0, 0.1, 0.5


@dataclass(frozen=True)
class LossWeights:
    pref: Tensor  # LensNet's Bradley–Terry preference term
    budget: Tensor  # its budget term
    temperature: Tensor  # the preference pairs' weight over their ΔNLL
    attention: Tensor  # loss_lens_attn, the teacher's attention as LensNet's target
    full: Tensor  # loss_full, the full-window teacher's own next-token loss
    recon: Tensor  # loss_recon, every gist read back into its own tokens

    @classmethod
    def of(cls, mc: MCConfig, device: torch.device) -> LossWeights:
        lens, teacher = mc.lens, mc.teacher
        values = {
            "pref": PREF_WEIGHT,
            "budget": BUDGET_WEIGHT,
            "temperature": TEMPERATURE,
            "attention": lens.attention_weight,
            "full": teacher.full_weight,
            "recon": mc.gist.recon_weight,
        }
        return cls(**{name: torch.tensor(float(value), device=device) for name, value in values.items()})

    def values(self) -> dict[str, float]:
        """The weights as numbers, by field name (host reads: for logs and tests, never in the step)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}
