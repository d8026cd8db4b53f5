"""Entry points, run from the repository root as ``python -m train.<name>``."""
