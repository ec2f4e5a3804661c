"""The layers: token mixers (decayed linear attention, Gated DeltaNet, Kimi Delta Attention, gated MLA)
and the residual schemes (PreNorm, Full and Block Attention Residuals). Each mixer is
``forward(x [B, T, D], cache=None) -> (y, cache)`` and calls the ops or the Triton kernels, on floors below
(tests/test_floors.py).
"""

from k3course.layers.kda import DecayedLinearAttention, GatedDeltaNet, KDACache, KimiDeltaAttention
from k3course.layers.mla import GatedMLA, MLACache
from k3course.layers.residual import BlockAttnRes, FullAttnRes, StandardResidual, make_residual

__all__ = ["BlockAttnRes", "DecayedLinearAttention", "FullAttnRes", "GatedDeltaNet", "GatedMLA", "KDACache",
           "KimiDeltaAttention", "MLACache", "StandardResidual", "make_residual"]
