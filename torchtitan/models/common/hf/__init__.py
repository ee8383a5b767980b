"""Hugging Face interop shared by the families: a family declares an :class:`HFMapping` (names,
tensor transforms, experts, config translation; ``mapping.py``, ``config.py``, with the
Llama-style pieces in ``decoder.py``) and :class:`StateDictAdapter` (``adapter.py``) applies it
both ways (docs/extending.md, section 5)."""

from torchtitan.models.common.hf.adapter import StateDictAdapter
from torchtitan.models.common.hf.config import ConfigField, HFConfig
from torchtitan.models.common.hf.mapping import ExpertStack, HFMapping, OursOnly, RopeRows

__all__ = [
    "ConfigField",
    "ExpertStack",
    "HFConfig",
    "HFMapping",
    "OursOnly",
    "RopeRows",
    "StateDictAdapter",
]
