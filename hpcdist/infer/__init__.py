"""Distributed inference (node side: every rank runs it): checkpoint loading (broadcast or per-rank
shards), tensor-parallel GPT, batched KV-cache generation, and its metrics.

Import the submodules you need; this package imports nothing heavy itself, so the login node
can validate an inference spec (``hpcdist.infer.params``) without torch.
"""
