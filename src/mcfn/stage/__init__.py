"""The focus stage: what happens to the focus policy after a run's training. The LensNet stage's rounds
(``rounds``: trace, train, measure) on counterfactual traces (``traces``), its labels and how much signal they carry
(``labels``, ``reliability``, ``carried``), the candidate LensNets (``candidates``), how a round is measured
(``judge``), and the choice of the policy a run ships (``ship``).

It imports the evaluation, the data, the core and the checkpoint file below it; the shell (the trainer's end,
``train.lens``, ``train.ship``) imports it, never the reverse (``pyproject.toml``'s contracts)."""
