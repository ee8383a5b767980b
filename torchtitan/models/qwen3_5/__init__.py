"""Qwen3.5 dense and MoE text decoders (Gated DeltaNet + gated full attention): arguments,
flavors, the module, its parallel plan and its Hugging Face mapping, put together as a
``FamilySpec`` (models/spec.py; docs/qwen3_5.md)."""

from __future__ import annotations

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.qwen3_5.args import QWEN35_FLAVORS, Qwen35Args
from torchtitan.models.qwen3_5.hf import QWEN35_HF, Qwen35StateDictAdapter
from torchtitan.models.qwen3_5.model import Qwen35Transformer
from torchtitan.models.qwen3_5.parallel_plan import qwen35_parallel_plan
from torchtitan.models.spec import FamilySpec

qwen3_5_spec = FamilySpec(
    name="qwen3_5", flavors=QWEN35_FLAVORS, model=Qwen35Transformer, plan=qwen35_parallel_plan,
    hf=QWEN35_HF, hf_model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
    # also reads the text decoder of the published multimodal checkpoints (hf.py)
    adapter=Qwen35StateDictAdapter,
    lora_targets=("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "linear_attn.wqkv", "linear_attn.wz", "linear_attn.wo"),
    hooks=MOE_HOOKS,
)  # fmt: skip

__all__ = ["QWEN35_FLAVORS", "Qwen35Args", "Qwen35Transformer", "qwen3_5_spec"]
