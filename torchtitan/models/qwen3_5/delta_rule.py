"""The gated delta rule of Qwen3.5's linear-attention layers (docs/qwen3_5.md), three ways:

* :func:`recurrent_delta_rule`: the definition, one token at a time (the reference the others
  are tested against). Per value head, with the state ``S`` ``[Dk, Dv]``::

      S <- exp(g_t) * S                     (decay; S <- 0 where a new document starts)
      u_t = beta_t * (v_t - S^T k_t)        (the delta: what S mispredicts for k_t)
      S <- S + k_t u_t^T
      o_t = S^T q_t

* :func:`chunked_delta_rule`: the same numbers, computed a chunk of ``C`` tokens at a time
  (pure PyTorch, any device, exact up to float rounding). Inside a chunk the ``u_t`` solve one
  unit lower-triangular system ``(I + A) U = B`` (``A[t, j] = beta_t D[t, j] k_t . k_j``,
  ``D[t, j] = exp(G_t - G_j)`` the decay from ``j`` to ``t``, ``G`` the in-chunk cumulative
  ``g``), so only the state crossing chunk boundaries is sequential.
* :func:`fla_delta_rule`: flash-linear-attention's chunked Triton kernel (CUDA, optional
  extra ``fla``), packed documents given as ``cu_seqlens``.

Document masking: ``doc_ids`` ``[B, S]`` (non-decreasing per row). Every form resets the state
where a document starts, so no document reads another's state.

Shapes: ``q, k`` ``[B, S, H, Dk]`` (already repeated to the value heads, L2-normalized and
scaled), ``v`` ``[B, S, H, Dv]``, ``g, beta`` ``[B, S, H]``. Computed in float32.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "affine_delta_rule",
    "chunked_delta_rule",
    "chunked_delta_rule_state",
    "delta_rule",
    "fla_available",
    "fla_delta_rule",
    "recurrent_delta_rule",
]


def _starts(doc_ids: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
    """Bool ``[B, S]``: the token begins a document (its state starts from zero)."""
    if doc_ids is None:
        out = torch.zeros(b, s, dtype=torch.bool, device=device)
    else:
        out = torch.ones(b, s, dtype=torch.bool, device=device)
        out[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    out[:, 0] = True
    return out


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, token by token (module docstring); returns ``o`` ``[B, S, H, Dv]``."""
    b, s, h, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    keep = (~_starts(doc_ids, b, s, q.device)).float()
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for t in range(s):
        decay = g[:, t].exp() * keep[:, t, None]
        state = state * decay[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        u = beta[:, t, :, None] * (v[:, t] - pred)
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(out, dim=1)


def _chunk(x: torch.Tensor, c: int) -> torch.Tensor:
    """``[B, S, H, ...]`` (S a multiple of c) -> ``[B, H, N, C, ...]``."""
    b, s, h = x.shape[:3]
    return x.reshape(b, s // c, c, h, *x.shape[3:]).transpose(2, 3).transpose(1, 2)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The chunked form (module docstring); equal to :func:`recurrent_delta_rule`."""
    return chunked_delta_rule_state(q, k, v, g, beta, doc_ids, chunk_size)[0]


def chunked_delta_rule_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_delta_rule` from ``initial_state`` (``[B, H, Dk, Dv]``, default zero;
    the first token's document reads it) -> (``o``, the state after the last token)."""
    b, s, h, _ = k.shape
    c = chunk_size
    pad = (-s) % c
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    docs = (
        doc_ids.to(torch.int64)
        if doc_ids is not None
        else torch.zeros(b, s, dtype=torch.int64, device=q.device)
    )
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        docs = torch.cat([docs, docs[:, -1:].expand(b, pad)], dim=1)
    n = (s + pad) // c
    qc, kc, vc = _chunk(q, c), _chunk(k, c), _chunk(v, c)  # [B, H, N, C, D]
    gc, bc = _chunk(g, c), _chunk(beta, c)  # [B, H, N, C]
    dc = docs.view(b, n, c)[:, None]  # [B, 1, N, C]
    prev = torch.cat([docs[:, :1], docs[:, :-1]], dim=1).view(b, n, c)[:, None, :, :1]
    cum = gc.cumsum(-1)
    same = dc[..., :, None] == dc[..., None, :]  # [B, 1, N, C, C]: same document
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~(same & causal), float("-inf"))
    decay = diff.exp()  # D[t, j], zero across documents and above the diagonal
    reads = (dc == prev).float() * cum.exp()  # how much of the carried state token t sees
    kk = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
    eye = torch.eye(c, device=q.device)
    system = eye + kk.tril(-1)
    vb = vc * bc[..., None]
    kb = kc * (bc * reads)[..., None]
    w = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    wk = torch.linalg.solve_triangular(system, kb, upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay
    q_read = qc * reads[..., None]
    last_same = (dc == dc[..., -1:]).float()  # tokens of the chunk's last document
    k_write = kc * (last_same * (cum[..., -1:] - cum).exp())[..., None]
    carry = (dc[..., :1] == prev).float()[..., 0] * cum[..., -1].exp()  # [B, H|1, N]
    carry = carry * (dc[..., -1] == dc[..., 0]).float()
    state = (
        q.new_zeros(b, h, k.shape[-1], v.shape[-1])
        if initial_state is None
        else initial_state.float()
    )
    outs = []
    for i in range(n):
        u = w[:, :, i] - wk[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * carry[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    out = out.transpose(1, 2).transpose(2, 3).reshape(b, n * c, h, -1)
    return out[:, :s], state


def affine_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule over a stretch whose entering state ``S0`` is not known yet (context parallel:
    the previous rank's). Every step is affine in the state, so the state after token ``t`` is
    ``P_t @ S0 + B_t`` and ``o_t = o0_t + S0^T qe_t`` with ``qe_t = P_t^T q_t``. One chunked
    pass computes both parts, as the state ``[P | B]`` started at ``[I | 0]`` with values
    ``[0 | v]``: returns ``(o0, qe, P_end, B_end)``, the last two ``[B, H, Dk, Dk]`` and
    ``[B, H, Dk, Dv]`` (zero ``P`` past a document start: the state was reset)."""
    b, s, h, dk = k.shape
    v_aug = torch.cat([v.float().new_zeros(b, s, h, dk), v.float()], dim=-1)
    eye = torch.eye(dk, device=q.device).expand(b, h, dk, dk)
    start = torch.cat([eye, eye.new_zeros(b, h, dk, v.shape[-1])], dim=-1)
    out, state = chunked_delta_rule_state(q, k, v_aug, g, beta, doc_ids, initial_state=start)
    return out[..., dk:], out[..., :dk], state[..., :dk], state[..., dk:]


def fla_available() -> bool:
    """Whether flash-linear-attention is installed (its import errors are :func:`fla_problem`'s)."""
    return importlib.util.find_spec("fla") is not None


def fla_problem() -> str | None:
    """Why the installed flash-linear-attention cannot be used (its import error), or None."""
    if not fla_available():
        return None
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # noqa: BLE001 (any import failure is reported the same way)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _cu_seqlens(doc_ids: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
    """Start offsets of every document of the flattened batch, and the total (fla's varlen)."""
    starts = _starts(doc_ids, b, s, device).flatten().nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([b * s])]).to(torch.long)


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-linear-attention's chunked kernel: the batch flattened into one row of documents
    (``cu_seqlens``), so sequences and packed documents never share a state."""
    mod: Any = importlib.import_module("fla.ops.gated_delta_rule")
    b, s, h, dk = k.shape
    cu = _cu_seqlens(doc_ids, b, s, q.device)
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, _ = mod.chunk_gated_delta_rule(
        *flat, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=cu
    )
    return o.reshape(b, s, h, -1)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """The kernel ``kernel`` names: ``fla``, ``chunked`` (PyTorch), ``recurrent`` (the
    definition, slow) or ``auto`` (``fla`` for CUDA tensors when installed, else ``chunked``)."""
    if kernel == "auto":
        kernel = "fla" if q.is_cuda and fla_available() else "chunked"
    if kernel == "fla":
        return fla_delta_rule(q, k, v, g, beta, doc_ids)
    if kernel == "recurrent":
        return recurrent_delta_rule(q, k, v, g, beta, doc_ids)
    return chunked_delta_rule(q, k, v, g, beta, doc_ids)
