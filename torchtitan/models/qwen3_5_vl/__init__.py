"""Qwen3.5 with vision (``--model.name qwen3_5_vl``; docs/vlm.md): the Qwen3.5 text decoder
(``models/qwen3_5/``) fed by the shared vision tower (``models/common/vision/``), its flavors,
plan and Hugging Face mapping, as a ``FamilySpec``."""

from __future__ import annotations

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.qwen3_5_vl.args import QWEN35_VL_FLAVORS, Qwen35VLArgs
from torchtitan.models.qwen3_5_vl.hf import QWEN35_VL_HF, Qwen35VLStateDictAdapter
from torchtitan.models.qwen3_5_vl.model import Qwen35VLModel
from torchtitan.models.qwen3_5_vl.parallel_plan import qwen35_vl_parallel_plan
from torchtitan.models.spec import FamilySpec

qwen3_5_vl_spec = FamilySpec(
    name="qwen3_5_vl", flavors=QWEN35_VL_FLAVORS, model=Qwen35VLModel,
    plan=qwen35_vl_parallel_plan, hf=QWEN35_VL_HF,
    # the multimodal model types are read by qwen3_5 (its text decoder) by default
    hf_model_types=(),
    adapter=Qwen35VLStateDictAdapter,  # the tower under model.visual. (hf.py)
    lora_targets=(),
    hooks=MOE_HOOKS,  # the MoE flavors' aux loss, expert load, bias update
)  # fmt: skip

__all__ = ["QWEN35_VL_FLAVORS", "Qwen35VLArgs", "Qwen35VLModel", "qwen3_5_vl_spec"]
