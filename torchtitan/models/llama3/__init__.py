"""Llama 3 (3, 3.1, 3.2 text) decoder-only transformer: arguments, flavors and the module."""

from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.spec import ModelSpec

llama3_spec = ModelSpec(
    name="llama3",
    flavors=LLAMA3_FLAVORS,
    model_cls=Transformer,
    parallelize=parallelize_llama,
    state_dict_adapter=Llama3StateDictAdapter,
    supports_context_parallel=True,
)

__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "llama3_spec"]
