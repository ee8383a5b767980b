"""A second model family that exists only for the tests: the worked example of
docs/extending.md, kept honest by tests/distributed/test_toy_model_parity.py.

A small GPT-style decoder that differs from Llama 3 wherever the generic layers could have
silently assumed Llama's insides: other module names (``embed``, ``blocks``, ``ln_f``,
``lm_head``; ``attn.q``/``proj``, ``mlp.fc``/``proj``), LayerNorm with bias instead of RMSNorm,
a GELU MLP instead of SwiGLU, no positional encoding at all (causal attention alone orders the
tokens), and no context-parallel plan (validation must refuse CP for it).

Importing this module registers the family as ``toy`` in ``MODELS`` (one line, as a real
family's would be in ``torchtitan/models/__init__.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.distributed.init_weights import ParamInit, init_params_deterministic
from torchtitan.distributed.model_plan import ModelParallelPlan, TensorParallelPlan
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.models import MODELS
from torchtitan.models.spec import NO_HOOKS, FamilyHooks


@dataclass
class ToyArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 2048
    max_seq_len: int = 512


class ToyAttention(nn.Module):
    def __init__(self, a: ToyArgs) -> None:
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.q, self.k, self.v = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Local heads from the shapes: under TP each rank holds n_heads / tp of them.
        q, k, v = (
            t(x).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class ToyMLP(nn.Module):
    def __init__(self, a: ToyArgs) -> None:
        super().__init__()
        self.fc = nn.Linear(a.dim, a.mlp_ratio * a.dim, bias=False)
        self.proj = nn.Linear(a.mlp_ratio * a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ToyBlock(nn.Module):
    def __init__(self, a: ToyArgs) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.attn, self.mlp = ToyAttention(a), ToyMLP(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ToyModel(nn.Module):
    """``embed``, ``ln_f`` and ``lm_head`` may be ``None`` on a pipeline stage."""

    embed: nn.Embedding | None
    ln_f: nn.LayerNorm | None
    lm_head: nn.Linear | None

    def __init__(self, a: ToyArgs) -> None:
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.blocks = nn.ModuleDict({str(i): ToyBlock(a) for i in range(a.n_layers)})
        self.ln_f = nn.LayerNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else h

    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        plan = {}
        for name, _ in self.named_parameters():
            fqn = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            plan[fqn] = _init_rule(fqn, self.args)
        init_params_deterministic(self, plan, seed)


def _init_rule(fqn: str, a: ToyArgs) -> ParamInit:
    if ".ln" in f".{fqn}":  # ln1, ln2, ln_f
        return ParamInit("ones" if fqn.endswith("weight") else "zeros")
    if fqn.endswith("proj.weight"):  # residual outputs, scaled by depth
        return ParamInit("normal", std=0.02 / math.sqrt(2 * a.n_layers))
    return ParamInit("normal", std=0.02)


def toy_parallel_plan(a: ToyArgs) -> ModelParallelPlan:
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    reduce_scatter = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    block = {
        "ln1": SequenceParallel(),
        "attn": gather,
        **{f"attn.{n}": ColwiseParallel() for n in ("q", "k", "v")},
        "attn.proj": reduce_scatter,
        "ln2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": reduce_scatter,
    }
    root = {
        "embed": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "ln_f": SequenceParallel(),
    }
    units = (
        PipelineUnit("embed", ("embed",)),
        *(PipelineUnit(f"blocks.{i}", (f"blocks.{i}",)) for i in range(a.n_layers)),
        PipelineUnit("head", ("ln_f", "lm_head")),
    )
    return ModelParallelPlan(
        blocks="blocks",
        pipeline_units=units,
        tensor_parallel=TensorParallelPlan(
            root=root,
            block=block,
            output="lm_head",
            divisible={"n_heads": a.n_heads, "mlp_width": a.mlp_ratio * a.dim},
        ),
        embedding="embed",
    )


@dataclass(frozen=True)
class ToySpec:
    name: str = "toy"
    flavors: Mapping[str, ToyArgs] = field(
        default_factory=lambda: {"tiny": ToyArgs(), "wide": ToyArgs(dim=128, n_heads=8)}
    )
    hooks: FamilyHooks = NO_HOOKS  # nothing added to the training loop

    def build(self, args: ToyArgs) -> nn.Module:
        return ToyModel(args)

    def parallel_plan(self, args: ToyArgs) -> ModelParallelPlan:
        return toy_parallel_plan(args)

    def num_params(self, a: ToyArgs) -> int:
        block = 4 * a.dim * a.dim + 2 * a.mlp_ratio * a.dim * a.dim + 4 * a.dim
        return 2 * a.vocab_size * a.dim + a.n_layers * block + 2 * a.dim

    def flops_per_token(self, a: ToyArgs, seq_len: int) -> int:
        dense = self.num_params(a) - a.vocab_size * a.dim  # the embedding lookup is no matmul
        return 6 * dense + 12 * a.n_layers * a.dim * seq_len

    def state_dict_adapter(self, args: ToyArgs) -> None:
        return None


MODELS["toy"] = ToySpec()
