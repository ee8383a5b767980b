"""The step guards: the non-finite gradient guard and the loss-spike policies (skip, roll
back to the last checkpoint, abort) that decide whether a step is applied.

May import: ``tools``, ``config``, ``distributed``.
"""
