"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): attention sinks, alternating sliding-window and full
attention, YaRN RoPE and a biased, clamped Mixture-of-Experts in every block; arguments,
flavors, the module, its parallel plan and its Hugging Face mapping, put together as a
``FamilySpec`` (models/spec.py; docs/gpt_oss.md)."""

from __future__ import annotations

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs
from torchtitan.models.gpt_oss.hf import GPT_OSS_HF
from torchtitan.models.gpt_oss.model import Transformer
from torchtitan.models.gpt_oss.parallel_plan import gpt_oss_parallel_plan
from torchtitan.models.spec import FamilySpec

gpt_oss_spec = FamilySpec(
    name="gpt_oss", flavors=GPT_OSS_FLAVORS, model=Transformer, plan=gpt_oss_parallel_plan,
    hf=GPT_OSS_HF, hf_model_types=("gpt_oss",),
    hooks=MOE_HOOKS,
)  # fmt: skip

__all__ = ["GPT_OSS_FLAVORS", "GptOssArgs", "Transformer", "gpt_oss_spec"]
