"""The only package that touches cffi: ggml contexts, tensors, devices, buffers, graphs.

Everything above this package speaks in these Python types. Loading is lazy: importing
``pyggspec.ggml`` does not compile or load the native extension until first use.
"""

from pyggspec.ggml.dtypes import GGMLType, numpy_dtype

__all__ = [
    "GGMLType",
    "numpy_dtype",
]
