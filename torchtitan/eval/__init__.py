"""Evaluation of the model being trained: the held-out validation loss run every
``validation.freq`` steps.

May import: ``tools``, ``config``, ``distributed``, ``data``, ``metrics``, ``loss``.
"""
