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

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.models.common.attention import AttentionMask
from torchtitan.models.common.moe_hooks import MOE_HOOKS, expert_load_metrics
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.spec import MetricsSource, PipelineSource

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


def mtp_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """int ``[B, S, depth + 1]``: column ``j`` is ``tokens`` shifted by ``j + 1``, padded with
    ``IGNORE``. Module ``k`` embeds column ``k - 1`` (the pad read as token 0) and predicts
    column ``k``. Made from the whole sequence before context parallel shards it (the shift
    crosses the shards' boundaries) and given to every pipeline stage (the last one, holding the
    MTP modules, has no token ids of its own)."""
    return torch.stack([shifted(tokens, j, IGNORE) for j in range(1, depth + 2)], dim=-1)


def mtp_embeddings(embedding: nn.Module, shifted_tokens: torch.Tensor) -> list[torch.Tensor]:
    """The shared embedding of each module's input tokens (``mtp_tokens``' columns but the
    last; the pad embedded as token 0)."""
    columns = shifted_tokens[..., :-1].clamp(min=0).unbind(-1)
    return [embedding(c) for c in columns]


def mtp_loss(
    modules: nn.ModuleDict,
    output: nn.Module,
    hidden: torch.Tensor,
    embeddings: list[torch.Tensor],
    shifted_tokens: torch.Tensor,
    freqs_cis: torch.Tensor,
    mask: AttentionMask | None,
    weight: float,
    cp_mesh: DeviceMesh | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight / D * sum_k CE_k, 1 / D * sum_k CE_k)`` over the ``D`` modules: the loss that
    trains and the unweighted mean that is logged (see the module docstring). ``embeddings``
    and ``shifted_tokens``: ``mtp_embeddings`` and ``mtp_tokens`` of the inputs. Under context
    parallel (``cp_mesh``) each rank holds part of every sequence: its CE sum is divided by the
    whole sequences' target count and multiplied by ``cp``, so the cp ranks' losses (and
    gradients, which FSDP averages over ``dp_shard x cp``) average to the one-process mean."""
    total = torch.zeros((), device=shifted_tokens.device)
    h = hidden
    cp = 1 if cp_mesh is None else cp_mesh.size()
    for k, module in enumerate(modules.values(), start=1):
        assert isinstance(module, MTPModule)
        h = module(h, embeddings[k - 1], freqs_cis, mask)
        logits = output(module.norm(h))
        targets = shifted_tokens[..., k]
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        if isinstance(ce, DTensor):  # loss parallel: a replicated scalar
            ce = ce.to_local()
        count = (targets != IGNORE).sum()
        if cp_mesh is not None:
            count = funcol.all_reduce(count, "sum", cp_mesh)
        total = total + ce * cp / count.clamp(min=1)
    mean = total / len(modules)
    return mean * weight, mean


class MTPMetrics:
    """A metrics source (``MetricsProcessor.extra_fields``, like ``ExpertLoadMetrics``): the
    mean MTP loss (unweighted, averaged over the depths) since the last log step, averaged over
    the data-parallel ranks ``mesh``; ``mtp/loss`` in the metrics, next to the main loss.
    ``model`` is None on a pipeline rank without the MTP modules: it logs the value of ``pp``'s
    rank (one broadcast of two numbers at log steps)."""

    def __init__(
        self, model: nn.Module | None, mesh: DeviceMesh | None, pp: PipelineSource | None = None
    ) -> None:
        self.sums = model.get_buffer("mtp_since_log") if model is not None else None
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.pp = pp

    @torch.no_grad()
    def __call__(self) -> tuple[dict[str, float | int | None], str]:
        if self.sums is not None:
            packed = self.sums.clone()
            self.sums.zero_()
        else:
            device = self.pp[0].device_type if self.pp is not None else "cpu"
            packed = torch.zeros(2, device=device)
        if self.mesh is not None:
            dist.all_reduce(packed, group=self.mesh.get_group())
        if self.pp is not None:
            pp_mesh, src = self.pp
            dist.broadcast(packed, group=pp_mesh.get_group(), group_src=src)
        total, count = packed.tolist()
        if count == 0:
            return {}, ""
        return {"mtp/loss": total / count}, f"  mtp {total / count:.4f}"


def mtp_metrics(
    parts: list[nn.Module], mesh: DeviceMesh | None, pp: PipelineSource | None
) -> list[MetricsSource]:
    """The MTP loss of this rank's model ``parts``, averaged over ``mesh``; under pipeline
    parallel ``pp`` (the pp mesh and the pp rank of the last stage) every pp rank logs the last
    stage's value."""
    if parts[0].args.mtp_depth == 0:  # type: ignore[union-attr]
        return []
    holder = next((p for p in parts if getattr(p, "mtp", None) is not None), None)
    return [MTPMetrics(holder, mesh, pp)]


def moe_and_mtp_metrics(
    parts: list[nn.Module], mesh: DeviceMesh | None, pp: PipelineSource | None
) -> list[MetricsSource]:
    return expert_load_metrics(parts, mesh, pp) + mtp_metrics(parts, mesh, pp)


DEEPSEEK_V3_HOOKS = dataclasses.replace(MOE_HOOKS, metrics_fields=moe_and_mtp_metrics)
"""The MoE hooks (``models/common/moe_hooks.py``), the MTP loss among the metrics; the MTP
loss's gradient seed is set by the MoE hook's ``after_build`` (the model has an
``aux_loss_scale``)."""
