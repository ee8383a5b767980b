"""Kimi K2.5 (``--model.name kimi_k25``; docs/vlm.md, "Kimi K2.5"): the DeepSeek-V3 decoder
(``models/deepseek_v3/``) fed by a MoonViT tower and projector
(``models/common/vision/moonvit.py``), its flavors, plan and Hugging Face mapping, as a
``FamilySpec``."""

from __future__ import annotations

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.kimi_k25.args import KIMI_K25_FLAVORS, KimiK25Args
from torchtitan.models.kimi_k25.hf import KIMI_K25_HF, KimiK25Adapter
from torchtitan.models.kimi_k25.model import KimiK25Model
from torchtitan.models.kimi_k25.parallel_plan import kimi_k25_parallel_plan
from torchtitan.models.spec import FamilySpec

kimi_k25_spec = FamilySpec(
    name="kimi_k25", flavors=KIMI_K25_FLAVORS, model=KimiK25Model,
    plan=kimi_k25_parallel_plan, hf=KIMI_K25_HF, hf_model_types=("kimi_k25",),
    adapter=KimiK25Adapter,  # the tower and projector as they are (hf.py)
    lora_targets=(),
    hooks=MOE_HOOKS,  # the MoE aux loss, expert load, bias update (no MTP: args.py)
)  # fmt: skip

__all__ = ["KIMI_K25_FLAVORS", "KimiK25Args", "KimiK25Model", "kimi_k25_spec"]
