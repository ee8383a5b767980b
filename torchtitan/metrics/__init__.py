"""Training metrics: the per-step processor (loss, throughput, MFU, memory, stragglers,
cross-rank reductions at log steps) and its writers (console, JSONL, TensorBoard, W&B)
(docs/observability.md).

May import: ``tools``, ``config``, ``distributed``.
"""
