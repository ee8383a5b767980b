"""Optimizers and learning-rate schedules: building the optimizer from ``[optimizer]``, the
low-precision AdamW (bf16 moments, stochastic rounding) and the warm-up/decay schedules.

May import: ``tools``, ``config``, ``distributed``.
"""
