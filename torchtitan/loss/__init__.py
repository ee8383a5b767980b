"""The training loss: token-level cross-entropy in fp32 with the global token normalisation,
and the chunked output-head-plus-loss that never holds the whole logits tensor.

May import: ``tools``, ``config``, ``distributed``.
"""
