"""Qwen3.5 model arguments and the named flavors (dense and Mixture-of-Experts; docs/qwen3_5.md).

A Qwen3.5 text decoder interleaves two token mixers: Gated DeltaNet layers (linear attention
with a per-head recurrent state, ``linear_*`` fields) and gated full-attention layers (GQA whose
query projection also yields a sigmoid output gate, partial RoPE on the first
``partial_rotary_factor`` of each head). ``layer_types`` says which layer is which (the
published models: three DeltaNet layers, then one full-attention layer). Every RMSNorm except
the DeltaNet's output norm is zero-centred (``x_hat * (1 + w)``, ``w`` starting at 0). The MoE
flavors replace every feed-forward by routed experts plus one shared expert whose output a
sigmoid gate scales.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.args import DEBUG_SHAPE, DecoderArgsBase, cycle_layers
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3_5.delta_rule import fla_available, fla_problem

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_KINDS = (LINEAR, FULL)
KERNELS = ("auto", "fla", "chunked", "recurrent")


def interleaving(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """The published layout: every ``interval``-th layer full attention, the rest DeltaNet."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


@dataclass
class Qwen35Args(DecoderArgsBase):
    """Shape of a Qwen3.5 (dense or MoE) text decoder."""

    head_dim: int = 256  # type: ignore[assignment]
    """Width of one full-attention head."""
    intermediate_size: int = 12288
    """Dense SwiGLU width."""
    n_kv_heads: int = 4
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 262144
    vocab_size: int = 248320
    partial_rotary_factor: float = 0.25
    """Share of each full-attention head's channels RoPE rotates (the first ones)."""
    layer_types: tuple[str, ...] = ()
    """``linear_attention`` / ``full_attention`` per layer; empty: :func:`interleaving`."""
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution over q, k and v of the DeltaNet layers."""
    moe: MoEArgs | None = None
    shared_expert_dim: int = 0
    """Width of the sigmoid-gated shared expert of the MoE flavors (0: none)."""
    linear_kernel: str = "auto"
    """Delta-rule kernel: ``auto`` (flash-linear-attention on CUDA when installed, else the
    PyTorch chunked form), ``fla``, ``chunked`` or ``recurrent`` (docs/qwen3_5.md)."""

    qk_norm: ClassVar[bool] = False
    """The QK-norms are counted in ``mixer_shapes`` / ``block_saved_bytes`` (the estimator's
    generic QK-norm terms would count them in DeltaNet layers too)."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = interleaving(self.n_layers)
        self.layer_types = tuple(self.layer_types)
        problem = self.shape_problem()
        if problem is not None:
            raise problem
        super().__post_init__()

    def with_n_layers(self, n: int) -> Qwen35Args:
        """At depth ``n``: the linear/full interleaving continued (or cut)."""
        return replace(self, n_layers=n, layer_types=cycle_layers(self.layer_types, n))

    def shape_problem(self) -> ConfigError | None:
        """What is wrong with the Qwen3.5-specific fields (named as in ``config.json``), with
        the fix, or None."""
        types = self.layer_types
        if len(types) != self.n_layers or any(t not in LAYER_KINDS for t in types):
            return ConfigError(
                "layer_types",
                list(types),
                f"must list {self.n_layers} entries (num_hidden_layers), each one of "
                f"{list(LAYER_KINDS)}",
                "list one kind per layer, or leave it out for the published interleaving "
                "(every 4th layer full_attention)",
            )
        if self.linear_conv_kernel_dim < 1:
            return ConfigError(
                "linear_conv_kernel_dim",
                self.linear_conv_kernel_dim,
                "the DeltaNet's causal convolution needs a kernel of at least 1 token",
                "set it to 4 (every published Qwen3.5)",
            )
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            return ConfigError(
                "linear_num_value_heads",
                self.linear_num_value_heads,
                f"must be a multiple of linear_num_key_heads={self.linear_num_key_heads} (each "
                "key head serves a group of value heads)",
                f"use a multiple of {self.linear_num_key_heads}",
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            return ConfigError(
                "partial_rotary_factor",
                self.partial_rotary_factor,
                f"gives {self.rotary_dim} rotary channels of head_dim={self.head_dim}; they must "
                "be even and at most head_dim",
                "use 0.25 (the published models) or another factor giving an even count",
            )
        if self.linear_kernel not in KERNELS:
            return ConfigError(
                "linear_kernel", self.linear_kernel, f"must be one of {list(KERNELS)}", "use auto"
            )
        return None

    def device_problem(self, device_type: str) -> ConfigError | None:
        """Why the delta-rule kernel cannot run on ``device_type`` (preflight asks before any
        process group): flash-linear-attention installed but failing to import, or asked for
        where it cannot run."""
        uses_fla = self.linear_kernel == "fla" or (
            self.linear_kernel == "auto" and device_type == "cuda" and fla_available()
        )
        if not uses_fla:
            return None
        if device_type != "cuda" or not fla_available():
            return ConfigError(
                "linear_kernel",
                "fla",
                f"flash-linear-attention needs CUDA and the fla package (device {device_type}, "
                f"installed: {fla_available()})",
                "use linear_kernel auto or chunked (the exact PyTorch form)",
            )
        broken = fla_problem()
        if broken is None:
            return None
        return ConfigError(
            "flash-linear-attention (import fla.ops.gated_delta_rule)",
            None,
            f"installed but fails to import ({broken})",
            "reinstall it (pip install 'torchtitan[fla]') or uninstall it to use the PyTorch "
            "chunked kernel",
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def hidden_dim(self) -> int:
        return self.intermediate_size

    def is_moe_layer(self, layer_id: int) -> bool:
        """Every block of an MoE flavor is MoE."""
        return self.moe is not None

    def is_linear(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == LINEAR

    @property
    def n_full_layers(self) -> int:
        return sum(not self.is_linear(i) for i in range(self.n_layers))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        # q (doubled for the gate), k, v, o and the two QK-norms
        return d * hd * (3 * self.n_heads + 2 * self.kv_heads) + 2 * hd

    def _linear_params(self) -> int:
        d, nv = self.dim, self.linear_num_value_heads
        inputs = d * (self.conv_dim + self.linear_value_dim + 2 * nv)  # qkv, z, b, a
        conv = self.conv_dim * self.linear_conv_kernel_dim
        return inputs + conv + 2 * nv + self.linear_value_head_dim + self.linear_value_dim * d

    def _ffn_params(self, layer_id: int, active: bool) -> int:
        if self.moe is None:
            return super()._ffn_params(layer_id, active)
        shared = 3 * self.dim * self.shared_expert_dim + (self.dim if self.shared_expert_dim else 0)
        return self.moe.num_params(self.dim, active=active) + shared

    def _layer_params(self, layer_id: int, active: bool) -> int:
        mixer = self._linear_params() if self.is_linear(layer_id) else self._attention_params()
        return mixer + self._ffn_params(layer_id, active) + 2 * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """``6 x`` active non-embedding parameters, plus per full-attention layer the scores
        (``12 n_heads head_dim seq_len``), plus per DeltaNet layer the chunked delta rule's
        matmuls, bounded in ``seq_len``: per token and value head, forward, the in-chunk
        ``k k^T`` and ``q k^T`` (``2 C Dk`` each), their product with the values (``2 C Dv``)
        and the state's read, correction and write (``2 Dk Dv`` each), chunks of ``C = 64``,
        times 3 for forward + backward; plus the gradient carried through each chunk's state
        (``8 Dk Dv``, none for the first chunk of a sequence). Equal to torch's FLOP counter
        on the chunked form (docs/qwen3_5.md)."""
        attention = 12 * self.n_full_layers * self.n_heads * self.head_dim * seq_len
        dk, dv, c = self.linear_key_head_dim, self.linear_value_head_dim, min(64, seq_len)
        chunks = -(-seq_len // c)
        carried = 8 * dk * dv * (chunks - 1) * c / seq_len
        per_head = 3 * (4 * c * dk + 2 * c * dv + 6 * dk * dv) + carried
        linear = (self.n_layers - self.n_full_layers) * self.linear_num_value_heads * per_head
        return int(6 * self.num_params(exclude_embedding=True, active=True) + attention + linear)

    def mixer_shapes(self, layer: int, tp: int) -> list[tuple[tuple[int, int], bool]]:
        """The estimator's view of block ``layer``'s token mixer after TP: each parameter's
        2-D shape and whether it is a matmul weight (``planner/memory_terms.py: layer_shapes``)."""
        return _mixer_shapes(self, layer, tp)

    def block_saved_bytes(self, layer: int, tokens: int, act: int, tp: int, mode: str) -> int:
        """Saved activations of block ``layer`` (:func:`block_saved_bytes`)."""
        return block_saved_bytes(self, layer, tokens, act, tp, mode)

    def delta_state_elems(self) -> int:
        """Elements of one sequence's recurrent state in one DeltaNet layer (per head, not per
        token: ``H x Dk x Dv``)."""
        return self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim


_DEBUG = Qwen35Args(
    **DEBUG_SHAPE, n_layers=4, n_kv_heads=2, head_dim=32, intermediate_size=512,
    linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=32, linear_value_head_dim=32,
)  # fmt: skip
_DEBUG_EXPERTS = MoEArgs(num_experts=8, top_k=2, expert_dim=128, aux_loss_coef=0.001)
_experts = partial(MoEArgs, aux_loss_coef=0.001)
"""The published MoE layer: softmax top-k, load-balancing loss weight 0.001."""

QWEN35_FLAVORS: dict[str, Qwen35Args] = {
    # Both layer kinds: layers 0-2 DeltaNet, layer 3 full attention.
    "debugmodel": _DEBUG,
    "debugmodel_moe": replace(_DEBUG, moe=_DEBUG_EXPERTS, shared_expert_dim=128),
    # Published shapes (text_config of the Hugging Face config.json of Qwen/Qwen3.5-*); head
    # widths (256 full attention, 128 DeltaNet) and the vocabulary are the class defaults.
    "0.8B": Qwen35Args(dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, intermediate_size=3584,
                       linear_num_value_heads=16, tie_word_embeddings=True),
    "2B": Qwen35Args(dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, intermediate_size=6144,
                     linear_num_value_heads=16, tie_word_embeddings=True),
    "4B": Qwen35Args(dim=2560, n_layers=32, n_heads=16, n_kv_heads=4, intermediate_size=9216,
                     linear_num_value_heads=32, tie_word_embeddings=True),
    "9B": Qwen35Args(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, intermediate_size=12288,
                     linear_num_value_heads=32),
    "27B": Qwen35Args(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, intermediate_size=17408,
                      linear_num_value_heads=48),
    "35B-A3B": Qwen35Args(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2,
                          linear_num_value_heads=32, shared_expert_dim=512,
                          moe=_experts(num_experts=256, top_k=8, expert_dim=512)),
    "122B-A10B": Qwen35Args(dim=3072, n_layers=48, n_heads=32, n_kv_heads=2,
                            linear_num_value_heads=64, shared_expert_dim=1024,
                            moe=_experts(num_experts=256, top_k=8, expert_dim=1024)),
    "397B-A17B": Qwen35Args(dim=4096, n_layers=60, n_heads=32, n_kv_heads=2,
                            linear_num_value_heads=64, shared_expert_dim=1024,
                            moe=_experts(num_experts=512, top_k=10, expert_dim=1024)),
}  # fmt: skip
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``)."""

__all__ = ["FULL", "LINEAR", "QWEN35_FLAVORS", "Qwen35Args", "interleaving"]


def _mixer_shapes(a: Qwen35Args, layer: int, tp: int) -> list[tuple[tuple[int, int], bool]]:
    """The token mixer's parameters; in an MoE block also the gated shared expert (replicated
    under TP; the estimator adds the router and routed experts)."""
    d, s = a.dim, a.shared_expert_dim
    shared = [((s, d), True), ((d, s), True), ((s, d), True), ((1, d), True)] if s else []
    return _own_mixer_shapes(a, layer, tp) + shared


def _own_mixer_shapes(a: Qwen35Args, layer: int, tp: int) -> list[tuple[tuple[int, int], bool]]:
    d = a.dim
    if not a.is_linear(layer):
        q, kv, hd = a.n_heads * a.head_dim // tp, a.kv_heads * a.head_dim // tp, a.head_dim
        qk_norms = [((hd, 1), False), ((hd, 1), False)]
        return [((2 * q, d), True), ((kv, d), True), ((kv, d), True), ((d, q), True), *qk_norms]
    conv, value, heads = a.conv_dim // tp, a.linear_value_dim // tp, a.linear_num_value_heads // tp
    return [
        ((conv, d), True),  # wqkv
        ((value, d), True),  # wz
        ((heads, d), True),  # wb
        ((heads, d), True),  # wa
        ((conv, a.linear_conv_kernel_dim), False),
        ((heads, 1), False),  # A_log
        ((heads, 1), False),  # dt_bias
        ((a.linear_value_head_dim, 1), False),  # the gated output norm
        ((d, value), True),  # wo
    ]


def _mixer_saved(a: Qwen35Args, layer: int, act: int, tp: int, chunk: int) -> float:
    """Bytes one token's mixer saves (no activation checkpointing), counted from the code and
    checked with saved-tensor hooks (``tests/unit/test_qwen3_5_estimator.py``)."""
    d = a.dim
    if not a.is_linear(layer):
        q, kv = a.n_heads * a.head_dim / tp, a.kv_heads * a.head_dim / tp
        return (d + 8 * q + 6 * kv) * act + 3 * a.n_heads / tp * 4
    conv, value = a.conv_dim / tp, a.linear_value_dim / tp
    h, nk = a.linear_num_value_heads / tp, a.linear_num_key_heads / tp
    dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
    # projections, the convolution's shifted copies, SiLU in/out; the gated norm and wo input
    projected = d + (a.linear_conv_kernel_dim + 2) * conv + 5 * value
    # float32 inside the delta rule: normalized q/k, the repeated q/k and their chunk products,
    # the values' products, the C x C in-chunk matrices, the state entering each chunk
    # (H x Dk x Dv per sequence and chunk: per head, not per token), small per-head terms
    rule = 2 * nk * dk + 6 * h * dk + 5 * value + 6 * h * chunk + h * dk * dv / chunk + 12 * h
    return projected * act + rule * 4 + 2 * chunk


def block_saved_bytes(a: Qwen35Args, layer: int, tokens: int, act: int, tp: int, mode: str) -> int:
    """Bytes block ``layer`` saves for backward over ``tokens`` local tokens: the two
    zero-centred norms, the mixer (DeltaNet or gated attention), the dense SwiGLU (an MoE layer
    is the estimator's ``moe_activation_delta``). ``full``: the block input; ``op``: the block
    input and the mixer's projection outputs (estimated)."""
    d, hid = a.dim, a.hidden_dim
    if mode == "full":
        return int(tokens * d / tp * act)
    if mode == "op":
        width = (
            a.conv_dim + a.linear_value_dim if a.is_linear(layer) else 3 * a.n_heads * a.head_dim
        )
        return int(tokens * (d / tp + width / tp + d + hid / tp) * act)
    chunk = min(64, a.max_seq_len)
    norms = (4 * d / tp + d) * act + 2 * 4
    return int(tokens * (norms + 4 * hid / tp * act + _mixer_saved(a, layer, act, tp, chunk)))
