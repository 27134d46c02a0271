"""DFLOP: data-aware 3D parallelism and online microbatch balancing for multimodal LLM training."""

__version__ = "0.2.0"
