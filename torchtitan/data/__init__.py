"""The data pipeline: tokenizers (tiktoken, Hugging Face ``tokenizer.json``), text and chat
datasets, pretokenized shards and their manifests, mixtures, and the stateful, rank-sharded
loaders the trainer draws from (docs/data.md, docs/sft.md).

May import: ``tools``, ``config``, ``distributed``, ``loss`` (the label ignore index). Built by
``torchtitan.training.builders``; checked before launch by ``preflight``.
"""
