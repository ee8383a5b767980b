"""One DPO optimizer step (docs/posttrain.md, "DPO").

For each microbatch of preference rows the chosen and rejected sides are stacked into one batch
``[2B, S]`` and run in ONE forward of the policy; the reference's log-probs come from one
no-grad forward of the same batch inside ``Reference.active()`` (adapters off under LoRA, the
frozen shards swapped in otherwise). The loss is the mean over the pairs of the global batch:
each rank's pair-loss sum times ``dp / global pairs`` (FSDP/DDP average gradients over ``dp``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed import utils as dist_utils
from torchtitan.posttrain.logprobs import sequence_logprobs
from torchtitan.posttrain.losses import REFERENCE_FREE, DpoLossType, dpo_losses
from torchtitan.posttrain.reference import Reference

PreferenceBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""chosen inputs, chosen labels, rejected inputs, rejected labels, each ``[B, S]``."""

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")


@dataclass
class DpoSettings:
    loss_type: DpoLossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


def check_settings(s: DpoSettings) -> str | None:
    """The rule a setting breaks, or None."""
    if s.beta <= 0:
        return f"dpo.beta = {s.beta} must be > 0"
    if not 0 <= s.label_smoothing < 0.5:
        return f"dpo.label_smoothing = {s.label_smoothing} must lie in [0, 0.5)"
    if s.label_smoothing > 0 and s.loss_type not in ("robust", "simpo"):
        return f"dpo.label_smoothing applies to loss_type 'robust' or 'simpo', not {s.loss_type!r}"
    return None


@dataclass
class DpoStep:
    """The DPO loss, backward and optimizer step over a step's microbatches; see the module
    docstring. ``reference`` is None for a reference-free loss (SimPO)."""

    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    settings: DpoSettings
    reference: Reference | None
    dp_mesh: DeviceMesh | None
    device: torch.device
    max_norm: float = 1.0
    last: dict[str, float] = field(default_factory=dict)
    # (global mean loss, grad norm) -> whether the optimizer steps (the trainer's non-finite
    # guard); None always steps.
    before_update: Callable[[torch.Tensor, torch.Tensor], bool] | None = None

    def __post_init__(self) -> None:
        problem = check_settings(self.settings)
        if problem is not None:
            raise ValueError(problem)
        if self.reference is None and self.settings.loss_type not in REFERENCE_FREE:
            raise ValueError(f"dpo loss_type {self.settings.loss_type!r} needs a reference")

    @property
    def dp(self) -> int:
        return self.dp_mesh.size() if self.dp_mesh is not None else 1

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_mesh is not None and self.dp > 1:
            dist_utils.all_reduce_(t, self.dp_mesh, op="sum")
        return t

    def logps(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logprobs(self.parts[0](inputs), labels)

    def forward_backward(self, batch: PreferenceBatch, scale: torch.Tensor) -> torch.Tensor:
        """Loss, backward and the metric sums ``[5]`` of one microbatch."""
        c_in, c_lab, r_in, r_lab = (t.to(self.device) for t in batch)
        inputs, labels = torch.cat([c_in, r_in]), torch.cat([c_lab, r_lab])
        ref_c = ref_r = None
        if self.settings.loss_type not in REFERENCE_FREE:
            assert self.reference is not None
            with torch.no_grad(), self.reference.active():
                ref, _ = self.logps(inputs, labels)
            ref_c, ref_r = ref.chunk(2)
        logps, n_tokens = self.logps(inputs, labels)
        chosen, rejected = logps.chunk(2)
        n_c, n_r = n_tokens.chunk(2)
        s = self.settings
        scores = dpo_losses(
            chosen, rejected, ref_c, ref_r,
            loss_type=s.loss_type, beta=s.beta, label_smoothing=s.label_smoothing,
            chosen_tokens=n_c, rejected_tokens=n_r, simpo_gamma=s.simpo_gamma,
        )  # fmt: skip
        loss = scores.losses.sum() * scale
        loss.backward()
        c, r = scores.chosen_rewards, scores.rejected_rewards
        return torch.stack(
            [scores.losses.detach().sum(), c.sum(), r.sum(), (c - r).sum(), (c > r).float().sum()]
        )

    def run(self, batches: list[PreferenceBatch]) -> dict[str, float]:
        """One optimizer step over ``batches`` (this rank's microbatches); returns the metrics
        averaged over the pairs of the global batch (and ``grad_norm``)."""
        self.optimizer.zero_grad(set_to_none=True)
        pairs = self._sum(
            torch.tensor(float(sum(b[0].shape[0] for b in batches)), device=self.device)
        )
        scale = self.dp / pairs
        sums = torch.zeros(len(METRICS), device=self.device)
        for batch in batches:
            sums += self.forward_backward(batch, scale)
        params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        norm = dist_utils.clip_grad_norm_(params, self.max_norm)
        means = self._sum(sums) / pairs
        if self.before_update is None or self.before_update(means[0], norm):
            self.optimizer.step()
        self.lr_scheduler.step()
        self.last = dict(zip(METRICS, means.tolist(), strict=True)) | {"grad_norm": float(norm)}
        return self.last
