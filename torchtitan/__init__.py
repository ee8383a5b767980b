"""torchtitan: native-PyTorch training of Llama-style models at any parallelism."""

__version__ = "0.1.0"
