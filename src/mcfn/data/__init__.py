"""Data: document sources, the BPE tokenizer, the pre-tokenized token cache and window sampling."""
