"""pyggspec: Qwen3.5/3.6 GGUF inference and MTP speculative decoding on ggml, driven from Python."""

from pyggspec.errors import PyggspecError

__version__ = "0.1.0"
__all__ = ["PyggspecError", "__version__"]
