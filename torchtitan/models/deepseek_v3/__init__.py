"""DeepSeek-V3 (and V2-Lite-shaped) decoder-only transformers: multi-head latent attention,
dense then MoE blocks, YaRN RoPE and multi-token prediction; arguments, flavors, the module,
its parallel plan and its Hugging Face mapping, put together as a ``FamilySpec``
(models/spec.py; docs/deepseek_v3.md)."""

from __future__ import annotations

from torchtitan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.models.deepseek_v3.mtp import DEEPSEEK_V3_HOOKS
from torchtitan.models.deepseek_v3.parallel_plan import deepseek_v3_parallel_plan
from torchtitan.models.spec import FamilySpec

deepseek_v3_spec = FamilySpec(
    name="deepseek_v3", flavors=DEEPSEEK_V3_FLAVORS, model=Transformer,
    plan=deepseek_v3_parallel_plan, hf=DEEPSEEK_V3_HF, hf_model_types=("deepseek_v3",),
    adapter=DeepSeekV3Adapter,  # also converts the MTP layers (hf.py)
    lora_targets=tuple(f"attention.{w}" for w in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")),
    hooks=DEEPSEEK_V3_HOOKS,  # the MoE hooks and the MTP loss in the metrics (mtp.py)
)  # fmt: skip

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "Transformer", "deepseek_v3_spec"]
