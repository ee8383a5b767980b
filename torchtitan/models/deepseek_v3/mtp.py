"""Multi-token prediction (MTP), DeepSeek-V3 tech report section 2.2 (docs/deepseek_v3.md).

Module ``k`` (1..D) at position ``i`` combines the previous depth's hidden state
``h_i^{k-1}`` (``h^0``: the main model's last block, before the final norm) with the embedding
of token ``t_{i+k}``::

    h'_i^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])
    h^k    = block_k(h'^k)              # one transformer block, causal over the sequence
    logits = output(norm_k(h^k))         # predicts t_{i+k+1}

The embedding and the output head are the main model's (shared). The concatenation puts the
embedding first, as the released checkpoints' ``eh_proj`` does. The loss is
``mtp_loss_weight / D * sum_k CE_k``, ``CE_k`` the mean over the positions whose target lies
inside the sequence (the inputs of module ``k`` are the tokens shifted by ``k``, padded at the
end, so every tensor keeps the sequence length: sequence and tensor parallel split it as they
split the main model's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.models.common.attention import AttentionMask
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args

IGNORE = -100


class MTPModule(nn.Module):
    """One MTP depth: the two input norms, the projection, its block and its final norm."""

    def __init__(self, a: DeepSeekV3Args, block: nn.Module) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.hnorm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.eh_proj = nn.Linear(2 * a.dim, a.dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        emb: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """``h``: the previous depth's hidden states, ``emb``: the shifted tokens' embeddings;
        returns this depth's hidden states (before ``norm``)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x, freqs_cis, mask=mask)


def shifted(tokens: torch.Tensor, k: int, pad: int) -> torch.Tensor:
    """``tokens[:, k:]`` padded with ``pad`` back to the sequence length."""
    return F.pad(tokens[:, k:], (0, k), value=pad)


def mtp_loss(
    modules: nn.ModuleDict,
    embedding: nn.Module,
    output: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    freqs_cis: torch.Tensor,
    mask: AttentionMask | None,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight / D * sum_k CE_k, 1 / D * sum_k CE_k)`` over the ``D`` modules: the loss that
    trains and the unweighted mean that is logged (see the module docstring)."""
    total = torch.zeros((), device=tokens.device)
    h = hidden
    for k, module in enumerate(modules.values(), start=1):
        assert isinstance(module, MTPModule)
        h = module(h, embedding(shifted(tokens, k, 0)), freqs_cis, mask)
        logits = output(module.norm(h))
        targets = shifted(tokens, k + 1, IGNORE)
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        if isinstance(ce, DTensor):  # loss parallel: a replicated scalar
            ce = ce.to_local()
        total = total + ce / (targets != IGNORE).sum().clamp(min=1)
    mean = total / len(modules)
    return mean * weight, mean


class MTPMetrics:
    """A metrics source (``MetricsProcessor.extra_fields``, like ``ExpertLoadMetrics``): the
    mean MTP loss (unweighted, averaged over the depths) since the last log step, averaged over
    the data-parallel ranks ``mesh``; ``mtp/loss`` in the metrics, next to the main loss."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh | None) -> None:
        self.sums: torch.Tensor = model.get_buffer("mtp_since_log")  # [sum, count]
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None

    @torch.no_grad()
    def __call__(self) -> tuple[dict[str, float | int | None], str]:
        packed = self.sums.clone()
        self.sums.zero_()
        if self.mesh is not None:
            dist.all_reduce(packed, group=self.mesh.get_group())
        total, count = packed.tolist()
        if count == 0:
            return {}, ""
        return {"mtp/loss": total / count}, f"  mtp {total / count:.4f}"
