"""Token mixers: decay-gated linear attention, Gated DeltaNet and Kimi Delta Attention (recurrent, chunked,
layers), plus gated MLA. Layouts follow fla (DESIGN §5)."""

from k3course.attention.chunk import gdn_chunk, gla_chunk, kda_chunk
from k3course.attention.recurrent import gdn_recurrent, gla_recurrent, kda_recurrent

__all__ = ["gdn_chunk", "gdn_recurrent", "gla_chunk", "gla_recurrent", "kda_chunk", "kda_recurrent"]
