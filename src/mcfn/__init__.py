"""mcfn: MegaContext language models as a torch.compile-centric functional core."""

__version__ = "0.1.0"
