"""MegaContext: the summary tree, working-context variants, and the packed training step."""
