"""The ``hf`` family's Hugging Face adapter: our names are transformers' names, so every
tensor passes through unchanged, and ``config.json`` is the source file's with this run's
vocabulary (docs/hf_models.md). It offers what the streaming import/export of
``checkpoint/hf_io.py`` and ``convert.py`` call on any family's adapter."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf.mapping import Box, HFSource
from torchtitan.models.hf.args import HFArgs

_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class PassThroughAdapter:
    def __init__(self, args: HFArgs) -> None:
        self.args = args

    def _tied(self) -> bool:
        return self.args.tie_word_embeddings

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for key, w in sd.items() for k, v in self.to_hf_one(key, w)}

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        return [] if self.exports_nothing(key) else [(key, w.contiguous())]

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(hf)
        if self._tied() and _HEAD not in out and _EMBEDDING in out:
            out[_HEAD] = out[_EMBEDDING]
        return out

    def tied_to(self, key: str) -> str | None:
        return _EMBEDDING if self.exports_nothing(key) else None

    def exports_nothing(self, key: str) -> bool:
        """The tied head: transformers stores the shared matrix once, as the embedding."""
        return self._tied() and key == _HEAD

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        name = key
        if self.exports_nothing(key) and key not in source:
            name = _EMBEDDING
        return source.read(name, box)

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The source ``config.json`` with this model's vocabulary and dtype."""
        config = dict(self.args.hf_config)
        config["vocab_size"] = self.args.vocab_size
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
        config["use_cache"] = True
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(config.get(key), int) and config[key] >= self.args.vocab_size:
                config[key] = None
        return config
