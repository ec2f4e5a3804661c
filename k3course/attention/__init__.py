"""Token mixers: decay-gated linear attention, Gated DeltaNet and Kimi Delta Attention (recurrent, chunked,
layers), plus gated MLA. Layouts follow fla (DESIGN §5)."""

from k3course.attention.chunk import gdn_chunk, gla_chunk, kda_chunk
from k3course.attention.kda import DecayedLinearAttention, GatedDeltaNet, KDACache, KimiDeltaAttention
from k3course.attention.parallel import decay_attention_parallel, softmax_attention
from k3course.attention.recurrent import gdn_recurrent, gla_recurrent, kda_recurrent

__all__ = ["DecayedLinearAttention", "GatedDeltaNet", "KDACache", "KimiDeltaAttention", "decay_attention_parallel",
           "gdn_chunk", "gdn_recurrent", "gla_chunk", "gla_recurrent", "kda_chunk", "kda_recurrent",
           "softmax_attention"]
from k3course.attention.mla import GatedMLA  # noqa: E402, F401
