"""Eager inference at growing lengths: the streaming tree, its refocused context, the KV cache, decoding and
ASCII pictures of working contexts. Built on the core; nothing here is compiled."""
