"""Qwen3.5's layers (docs/qwen3_5.md): the zero-centred RMSNorm, gated full attention with
partial RoPE, the Gated DeltaNet, the MoE feed-forward with its sigmoid-gated shared expert.

Tensor parallel (``parallel_plan.py``) shards heads, so every layer takes its head counts from
tensor shapes. The DeltaNet's fused ``wqkv`` rows (and its convolution channels) are ordered by
key head: for each key head its q channels, its k channels, then the v channels of the value
heads it serves. A column shard of whole key heads is then this rank's heads of q, k and v
together (``hf.py`` permutes to and from Hugging Face's [all q | all k | all v] order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.context_parallel.linear import SequenceRelayout
from torchtitan.models.common.attention import AttentionCore, OptMask
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.kv_cache import OptCache
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.common.moe_experts import SharedExpert, local_linear
from torchtitan.models.common.rope import repeat_kv
from torchtitan.models.qwen3_5.args import Qwen35Args
from torchtitan.models.qwen3_5.delta_rule import affine_delta_rule, delta_rule


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local values (tensor parallel shards them; the gradient of the local
    shard is the shard's gradient)."""
    return p.to_local() if isinstance(p, DTensor) else p


class ZeroCenteredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, ``w`` starting at zero (Qwen3.5's block, final and
    QK norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def rotate_partial(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``2 * freqs_cis.shape[-1]`` channels of each head of ``x``
    ``[B, S, H, Dh]``, in the two-halves layout (channel ``i`` pairs with ``i + r/2``); the
    other channels pass. ``freqs_cis``: complex ``[S, r/2]`` or ``[B, S, r/2]``."""
    half = freqs_cis.shape[-1]
    f = freqs_cis[:, None] if freqs_cis.dim() == 2 else freqs_cis[:, :, None]
    cos, sin = f.real.to(x.dtype), f.imag.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    """GQA with zero-centred QK-norms and partial RoPE; ``wq`` gives each head its query and
    an output gate (``[q_h | gate_h]`` per head), the output is ``wo(attn * sigmoid(gate))``."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        d, hd = args.dim, args.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(d, 2 * args.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, args.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, args.kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, d, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(hd, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, args.norm_eps)
        self.core = AttentionCore()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        if cache is not None:
            raise ValueError("Qwen3.5 has no generation cache (docs/qwen3_5.md)")
        bs, seqlen, _ = x.shape
        qg = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim)
        xq, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = rotate_partial(self.q_norm(xq), freqs_cis)
        xk = rotate_partial(self.k_norm(xk), freqs_cis)
        n_rep = xq.shape[2] // xk.shape[2]
        q = xq.transpose(1, 2)
        k = repeat_kv(xk, n_rep).transpose(1, 2)
        v = repeat_kv(xv, n_rep).transpose(1, 2)
        out = self.core(q, k, v, mask).transpose(1, 2)  # [B, S, H, Dh]
        out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(bs, seqlen, -1))


def causal_conv(x: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence: ``out[t, c] = sum_s w[c, K-1-s] *
    x[t-s, c]`` for ``s < K``, terms before the sequence or in another document left out.
    ``x`` ``[B, S, C]``, ``w`` ``[C, K]``."""
    width = w.shape[1]
    out = x * w[:, width - 1]
    for shift in range(1, min(width, x.shape[1] + 1)):
        past = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        if doc_ids is not None:
            same = torch.zeros_like(doc_ids, dtype=torch.bool)
            same[:, shift:] = doc_ids[:, shift:] == doc_ids[:, :-shift]
            past = past * same[..., None].to(past.dtype)
        out = out + past * w[:, width - 1 - shift]
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule (``delta_rule.py``): fused q/k/v projection,
    causal depthwise convolution + SiLU, L2-normalized q and k, per-value-head decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and write strength ``beta = sigmoid(b)``,
    then an RMSNorm per head gated by ``silu(z)`` and the output projection."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        d, nv = args.dim, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.group = nv // args.linear_num_key_heads  # value heads per key head
        self.kernel = args.linear_kernel
        self.wqkv = nn.Linear(d, args.conv_dim, bias=False)
        self.wz = nn.Linear(d, args.linear_value_dim, bias=False)
        self.wb = nn.Linear(d, nv, bias=False)
        self.wa = nn.Linear(d, nv, bias=False)
        self.conv = nn.Parameter(torch.empty(args.conv_dim, args.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.norm = nn.RMSNorm(self.dv, eps=args.norm_eps)
        self.wo = nn.Linear(args.linear_value_dim, d, bias=False)
        self.cp_mesh: DeviceMesh | None = None  # set by context parallel

    def enable_context_parallel(self, mesh: DeviceMesh) -> None:
        """Called by context parallel (``distributed/context_parallel/core.py: apply_cp``): the
        layer then runs on this rank's contiguous stretch of the sequence, its state entering
        from the ranks before (``distributed/context_parallel/linear.py``). Its index
        bookkeeping runs eagerly: the block then compiles with graph breaks."""
        self.cp_mesh = mesh
        self.compile_graph_breaks = True  # read by distributed/compile.py

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        if cache is not None:
            raise ValueError("Qwen3.5 has no generation cache (docs/qwen3_5.md)")
        if self.cp_mesh is None:
            out = self._mix(x, None if mask is None else mask.doc_ids, None)
            return self.wo(out)
        # Under TP the gathered input is a replicated DTensor: relayout its local values.
        spec = (x.device_mesh, x.placements) if isinstance(x, DTensor) else None
        x_local = x.to_local() if isinstance(x, DTensor) else x
        relayout = SequenceRelayout(self.cp_mesh, x_local, mask, self.conv.shape[1] - 1)
        x_win = relayout.to_contiguous(x_local)
        if spec is not None:
            x_win = DTensor.from_local(x_win, *spec, run_check=False)
        out = self._mix(x_win, relayout.doc_ids, relayout)
        return self.wo(relayout.from_contiguous(out))

    def _mix(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None, relayout: SequenceRelayout | None
    ) -> torch.Tensor:
        """The layer up to ``wo`` (``[B, S, value_dim]``). Under CP ``x`` and ``doc_ids`` are
        the rank's stretch after ``relayout.halo`` tokens that only feed the convolution."""
        halo = 0 if relayout is None else relayout.halo
        mixed = F.silu(causal_conv(self.wqkv(x), local(self.conv), doc_ids))[:, halo:]
        x = x[:, halo:]
        docs = None if doc_ids is None else doc_ids[:, halo:]
        bs, seqlen, _ = x.shape
        mixed = mixed.view(bs, seqlen, -1, 2 * self.dk + self.group * self.dv)  # per key head
        q = _l2norm(mixed[..., : self.dk].float()) * self.dk**-0.5
        k = _l2norm(mixed[..., self.dk : 2 * self.dk].float())
        v = mixed[..., 2 * self.dk :].reshape(bs, seqlen, -1, self.dv)
        q, k = (t.repeat_interleave(self.group, dim=2) for t in (q, k))
        beta = torch.sigmoid(self.wb(x)).float()
        a = self.wa(x).float() + local(self.dt_bias).float()
        g = -local(self.A_log).float().exp() * F.softplus(a)
        if relayout is None:
            out = delta_rule(q, k, v, g, beta, docs, self.kernel).to(x.dtype)
        else:
            o0, q_eff, trans, contrib = affine_delta_rule(q, k, v, g, beta, docs)
            entering = relayout.incoming_state(trans, contrib)
            out = (o0 + torch.einsum("bshk,bhkv->bshv", q_eff, entering)).to(x.dtype)
        z = self.wz(x).view(bs, seqlen, -1, self.dv)
        out = (self.norm(out) * F.silu(z.float())).to(x.dtype)
        return out.reshape(bs, seqlen, -1)


class GatedSharedMoE(MoE):
    """The shared MoE layer (routed experts, ``models/common/moe.py``) plus one shared SwiGLU
    expert scaled per token by ``sigmoid(shared_gate(x))``."""

    def __init__(self, dim: int, args: MoEArgs, shared_dim: int) -> None:
        super().__init__(dim, args)
        self.shared_expert = SharedExpert(dim, shared_dim)
        self.shared_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        gate = torch.sigmoid(local_linear(self.shared_gate, x))
        return routed + gate * self.shared_expert(x)


class Qwen35Block(nn.Module):
    """Pre-norm block: ``h = x + mixer(norm(x)); out = h + ffn(norm(h))``, the mixer a
    DeltaNet (``linear_attn``) or gated attention (``attention``) by ``layer_types``."""

    def __init__(self, layer_id: int, args: Qwen35Args) -> None:
        super().__init__()
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.linear_attn: GatedDeltaNet | None = None
        self.attention: GatedAttention | None = None
        if args.is_linear(layer_id):
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.attention = GatedAttention(args)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module
        if args.moe is not None:
            self.feed_forward = GatedSharedMoE(args.dim, args.moe, args.shared_expert_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.intermediate_size)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        mixer = self.linear_attn if self.linear_attn is not None else self.attention
        assert mixer is not None
        h = x + mixer(self.attention_norm(x), freqs_cis, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))
