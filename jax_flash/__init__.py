"""jax_flash: FlashAttention for JAX, as XLA FFI handlers (Hopper CUDA kernels and C++ CPU kernels)."""

from ._extension import CudaHandlersNotBuiltWarning, build_info
from .attention import dot_product_attention, ring_attention, zigzag_order, zigzag_restore
from .capabilities import capabilities, gpu_available

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "ring_attention", "zigzag_order", "zigzag_restore",
           "build_info", "capabilities", "gpu_available", "CudaHandlersNotBuiltWarning",
           "__version__"]
