"""Rotary position embeddings shared by the decoder families (docs/extending.md): the table,
the rotation of query/key channel pairs, and the grouped-query repeat of key/value heads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _scale_rope_freqs(
    freqs: torch.Tensor,
    scaling_factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_seq_len: int,
) -> torch.Tensor:
    """Llama 3.1 long-context frequency scaling.

    Short wavelengths (high frequencies) are kept, long ones are divided by ``scaling_factor``,
    and the band in between blends the two linearly in ``original_max_seq_len / wavelength``.
    """
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_freqs_cis(
    head_dim: int,
    end: int,
    theta: float = 500000.0,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotary embedding table: ``complex64 [end, head_dim // 2]``, entry ``[p, i]`` is
    ``exp(1j * p * theta ** (-2i / head_dim))`` (with Llama 3.1 scaling when a factor is set)."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling_factor is not None:
        freqs = _scale_rope_freqs(
            freqs, scaling_factor, low_freq_factor, high_freq_factor, original_max_seq_len
        )
    return rope_table(freqs, end)


def rope_table(freqs: torch.Tensor, end: int, magnitude: float = 1.0) -> torch.Tensor:
    """``complex64 [end, len(freqs)]``: entry ``[p, i]`` is ``magnitude * exp(1j * p *
    freqs[i])``."""
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, magnitude), angles)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN ("NTK-by-parts") context extension of RoPE (Peng et al. 2023, arXiv:2309.00071,
    section 3.2; docs/gpt_oss.md), Hugging Face's ``rope_type: yarn`` fields.

    Dimension pair ``i`` rotates ``L / wavelength_i`` times over the original context ``L``. Pairs
    turning more than ``beta_fast`` times keep their frequency (extrapolation), pairs turning
    fewer than ``beta_slow`` times are divided by ``factor`` (interpolation), and a linear ramp
    over the pair index blends the two in between. The ramp's ends are the (fractional) pair
    indices where the rotation counts equal ``beta_fast`` / ``beta_slow``, rounded outward when
    ``truncate`` and clipped to ``[0, head_dim - 1]``. Cos and sin are scaled by
    ``attention_factor`` (default ``0.1 * ln(factor) + 1``), so the attention logits by its
    square.
    """

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    @property
    def magnitude(self) -> float:
        """The factor on cos/sin."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def inv_freq(
        self, head_dim: int, theta: float, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The scaled inverse frequencies, ``float32 [head_dim // 2]``."""
        half = head_dim // 2
        base = theta ** (torch.arange(0, head_dim, 2, device=device)[:half].float() / head_dim)

        def pair_index(rotations: float) -> float:  # the i with L / wavelength_i == rotations
            turns = self.original_max_seq_len / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(theta))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        index = torch.arange(half, device=device, dtype=torch.float32)
        keep = 1 - ((index - low) / (high - low)).clamp(0, 1)  # 1: extrapolate, 0: interpolate
        return (1.0 / (self.factor * base)) * (1 - keep) + (1.0 / base) * keep


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Hugging Face's ``rope_type: linear``): every frequency divided
    by ``factor``, as if positions were ``p / factor``."""

    factor: float
    magnitude = 1.0

    def inv_freq(
        self, head_dim: int, theta: float, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return base_inv_freq(head_dim, theta, device) / self.factor


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's long-context frequency scaling (``rope_type: llama3``; :func:`_scale_rope_freqs`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    magnitude = 1.0

    def inv_freq(
        self, head_dim: int, theta: float, device: torch.device | str | None = None
    ) -> torch.Tensor:
        freqs = base_inv_freq(head_dim, theta, device)
        return _scale_rope_freqs(
            freqs,
            self.factor,
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_seq_len,
        )


RopeScaling = LinearScaling | Llama3Scaling | YarnScaling
"""The RoPE scalings of Llama 3 and Qwen3 (each gives ``inv_freq`` and the cos/sin
``magnitude``); None is plain RoPE."""


def base_inv_freq(
    head_dim: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """Unscaled inverse frequencies ``theta ** (-2i / head_dim)``, ``float32 [head_dim // 2]``."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    return 1.0 / (theta**exponents)


def scaled_freqs_cis(
    head_dim: int,
    end: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The RoPE table ``complex64 [end, head_dim // 2]`` with ``scaling`` (None: plain)."""
    if scaling is None:
        return rope_table(base_inv_freq(head_dim, theta, device), end)
    return rope_table(scaling.inv_freq(head_dim, theta, device), end, scaling.magnitude)


def precompute_yarn_freqs_cis(
    head_dim: int,
    end: int,
    theta: float,
    yarn: YarnScaling,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The RoPE table with YaRN frequencies and magnitude (:class:`YarnScaling`):
    ``complex64 [end, head_dim // 2]``, used like :func:`precompute_freqs_cis`'s."""
    return rope_table(yarn.inv_freq(head_dim, theta, device), end, yarn.magnitude)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq`` / ``xk`` (``[B, S, H, Dh]``) by ``freqs_cis`` (``[S, Dh/2]`` or ``[B, S, Dh/2]``).

    Consecutive pairs of channels are treated as one complex number.
    """
    if freqs_cis.dim() == 2:  # [S, Dh/2] -> [1, S, 1, Dh/2]
        freqs = freqs_cis[None, :, None, :]
    else:  # [B, S, Dh/2] -> [B, S, 1, Dh/2]
        freqs = freqs_cis[:, :, None, :]
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    q_out = torch.view_as_real(q * freqs).flatten(3)
    k_out = torch.view_as_real(k * freqs).flatten(3)
    return q_out.type_as(xq), k_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, S, Hkv, Dh] -> [B, S, Hkv * n_rep, Dh]``, each kv head repeated ``n_rep`` times."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv * n_rep, head_dim)
    )
