"""Checkpoints: the DCP manager (save, async save, resume, seed and export checkpoints), the
on-disk side (atomic folders, manifests, Hugging Face safetensors folders), the rules that keep
a run from overwriting or loading the wrong thing, and the trust model for pickled state
(docs/checkpoint.md).

May import: ``tools``, ``config``, ``distributed``, ``guards`` (the finite-weights check before a
save).
"""
