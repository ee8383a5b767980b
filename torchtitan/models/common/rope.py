"""Rotary position embeddings shared by the decoder families (docs/extending.md): the table
(plain, Llama 3.1-scaled or YaRN-scaled),
the rotation of query/key channel pairs, and the grouped-query repeat of key/value heads."""

from __future__ import annotations

import math

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
    positions = torch.arange(end, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1.0 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_freqs(
    freqs: torch.Tensor,
    head_dim: int,
    theta: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN ("NTK-by-parts") frequency scaling of the base RoPE frequencies ``freqs``.

    A channel pair whose wavelength turns more than ``beta_fast`` times over the original
    context keeps its frequency (extrapolation), one turning fewer than ``beta_slow`` times is
    divided by ``factor`` (interpolation), and a linear ramp over the pair index blends the two
    in between. ``truncate`` rounds the ramp's ends to whole pairs (DeepSeek-V3; GPT-OSS does
    not)."""

    def pair(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times
        return (
            head_dim
            * math.log(original_max_seq_len / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    idx = torch.arange(head_dim // 2, dtype=torch.float32, device=freqs.device)
    keep = 1 - ((idx - low) / (high - low)).clamp(0, 1)  # 1: extrapolate, 0: interpolate
    return freqs / factor * (1 - keep) + freqs * keep


def precompute_yarn_freqs_cis(
    head_dim: int,
    end: int,
    theta: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float = 1.0,
    truncate: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The RoPE table with YaRN scaling (:func:`yarn_freqs`): ``complex64 [end, head_dim // 2]``
    of magnitude ``attention_factor`` (YaRN scales the rotated queries and keys by it; a family
    whose scale is ``yarn_mscale`` ratios passes that, docs/deepseek_v3.md)."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    freqs = yarn_freqs(
        freqs, head_dim, theta, factor, original_max_seq_len, beta_fast, beta_slow, truncate
    )
    angles = torch.outer(torch.arange(end, device=device, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, attention_factor), angles)
