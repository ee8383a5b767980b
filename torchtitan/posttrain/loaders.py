"""What the post-training modes draw each step, and the state they checkpoint beside the model
(docs/posttrain.md, "Running"):

- :class:`PreferenceLoader`: a data-parallel rank's microbatches of preference pairs;
- :class:`PromptLoader`: a rank's prompts of a GRPO step (global prompt ``g`` to rank ``g % dp``,
  ``prompts_per_step`` a step, cycling through the file);
- :class:`PosttrainState`: the reference's frozen shards and the sampling generator's state.

The loaders' ``state_dict`` has the checkpoint manager's dataloader shape (``dp_rank_<r>``: this
rank's position, ``dp_world_size``), so their position goes through its ``dataloader`` part.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from torchtitan.posttrain.dpo import PreferenceBatch
from torchtitan.posttrain.grpo import Prompt
from torchtitan.posttrain.preference_data import PreferenceDataset, preference_batches
from torchtitan.posttrain.reference import Reference


class PreferenceLoader:
    def __init__(self, dataset: PreferenceDataset, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self._batches: Iterator[tuple[torch.Tensor, ...]] | None = None

    def next_batches(self, n: int) -> list[PreferenceBatch]:
        if self._batches is None:
            self._batches = preference_batches(self.dataset, self.batch_size)
        return [next(self._batches) for _ in range(n)]  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        ds = self.dataset
        return {f"dp_rank_{ds.dp_rank}": ds.state_dict(), "dp_world_size": ds.dp_world_size}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # The position counts global pairs, the same on every rank.
        self.dataset.load_state_dict(next(v for k, v in sd.items() if k.startswith("dp_rank_")))
        self._batches = None


class PromptLoader:
    dataset = None  # no per-source metrics (the trainer asks)

    def __init__(self, prompts: list[Prompt], per_step: int, dp_rank: int, dp: int) -> None:
        self.prompts, self.per_step, self.dp_rank, self.dp = prompts, per_step, dp_rank, dp
        self.next_prompt = 0  # global prompts drawn so far

    def next_prompts(self) -> list[Prompt]:
        n, start = len(self.prompts), self.next_prompt
        self.next_prompt += self.per_step
        return [
            self.prompts[g % n] for g in range(start + self.dp_rank, start + self.per_step, self.dp)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            f"dp_rank_{self.dp_rank}": {"next_prompt": self.next_prompt},
            "dp_world_size": self.dp,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        own = next(v for k, v in sd.items() if k.startswith("dp_rank_"))
        self.next_prompt = int(own["next_prompt"])


class PosttrainState:
    """The ``posttrain`` part of a checkpoint: ``reference`` (the frozen copy's shards, laid out
    like the parameters) and ``generator`` (``rank_<r>``: this rank's sampling generator).

    A resume loads it before the step (and so the reference) exists: the loaded values wait
    in :attr:`pending` until :meth:`attach` gives them their owners."""

    def __init__(self, parts: list[torch.nn.Module], rank: int) -> None:
        self.parts, self.rank = parts, rank
        self.reference: Reference | None = None
        self.generator: torch.Generator | None = None
        self.pending: dict[str, Any] | None = None
        self.wants_reference = self.wants_generator = False

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.wants_reference:
            if self.reference is not None and self.reference.frozen is not None:
                out["reference"] = self.reference.frozen.sharded_state_dict()
            else:  # loading before attach: buffers of the parameters' layout
                out["reference"] = {
                    n: torch.empty_like(p.detach())
                    for part in self.parts
                    for n, p in part.named_parameters()
                    if p.requires_grad
                }
        if self.wants_generator:
            gen = self.generator if self.generator is not None else torch.Generator()
            out["generator"] = {f"rank_{self.rank}": gen.get_state()}
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pending = sd
        if self.reference is not None or self.generator is not None:
            self.attach(self.reference, self.generator)

    def attach(self, reference: Reference | None, generator: torch.Generator | None) -> None:
        """Own these; values loaded from a checkpoint replace theirs."""
        self.reference, self.generator = reference, generator
        sd, self.pending = self.pending or {}, None
        if "reference" in sd and reference is not None:
            reference.load_state_dict(sd["reference"])
        if "generator" in sd and generator is not None:
            generator.set_state(sd["generator"][f"rank_{self.rank}"])
