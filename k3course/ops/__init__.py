"""The ops: linear attention as functions of tensors (recurrent, chunked, parallel), RMSNorm and the
input checks. A leaf: it imports nothing of the package above ``debug``, and both the Triton kernels and the
layers import it. Layouts follow fla's (lesson 04): q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, gates per
channel ``[B, T, H, K]`` or per head ``[B, T, H]``, states ``[B, H, K, V]``.
"""

from k3course.ops.chunk import gdn_chunk, gla_chunk, kda_chunk, ut_transform
from k3course.ops.norm import rms_norm
from k3course.ops.parallel import decay_attention_parallel, softmax_attention
from k3course.ops.recurrent import gdn_recurrent, gla_recurrent, kda_recurrent, kda_step

__all__ = ["decay_attention_parallel", "gdn_chunk", "gdn_recurrent", "gla_chunk", "gla_recurrent", "kda_chunk",
           "kda_recurrent", "kda_step", "rms_norm", "softmax_attention", "ut_transform"]
