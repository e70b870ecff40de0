"""cake_ops: Mixture-of-Experts kernels for PyTorch, registered as ``torch.ops.cake.*``.

``cake_ops.grouped_gemm`` holds the ragged bf16 grouped GEMM (fwd / dgrad / wgrad, autograd,
prepared launches); ``cake_ops.grouped_mm_bf16`` is its stable entry point and
``cake_ops.grouped_mm`` takes ``torch._grouped_mm``'s arguments in its ragged forms.
``cake_ops.fused_moe.fused_moe_bf16`` is the pre-routed MoE forward and ``cake_ops.nn.FusedMoE``
a router-plus-experts module over it. Every op has a CPU
implementation, a fake (meta) implementation and, where differentiable, an autograd formula.
"""
import torch  # loads libtorch before the extension

from . import _C  # registers the schemas and the CPU / CUDA kernels
from . import _fake  # noqa: F401  (registers the fake implementations)
from . import fused_moe, grouped_gemm, moe, nn, stepfun_moe
from ._experimental import ExperimentalWarning
from .autotune import autotune, clear_tuning, load_tuning, save_tuning
from .grouped_gemm import grouped_mm, grouped_mm_bf16

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build of the extension holds: the SM targets with kernels ([] = CPU only)."""
    return {
        "version": __version__,
        "cuda_archs": [a for a in _C.CUDA_ARCHS.split(",") if a],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


__all__ = ["ExperimentalWarning", "autotune", "build_info", "clear_tuning", "fused_moe", "grouped_gemm",
           "grouped_mm", "grouped_mm_bf16", "load_tuning", "moe", "nn", "save_tuning", "stepfun_moe"]
