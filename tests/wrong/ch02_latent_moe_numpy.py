"""Plausible wrong answers for chapter 02's NumPy rung."""

import numpy as np

from k3course.reference import moe as ref


def swiglu_experts(x, params, top_k):
    """SwiGLU where SiTU-GLU was asked."""
    return ref.moe_forward(x, params, top_k)


def without_the_latent_norm(x, params, top_k):
    """Projects the combined latent up without normalising it first."""
    return ref.moe_forward(x, {**params, "latent_norm": np.ones_like(params["latent_norm"])}, top_k,
                           activation="situ_glu", eps=1e30) * 1e15


def norm_per_expert(x, params, top_k):
    """Normalises each expert's output before the weighted sum, instead of the sum."""
    expert_idx, weights = ref.topk_route(ref.sigmoid(x @ params["router"]), top_k, params["bias"])
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        latent = x[t] @ params["w_down_proj"]
        u = sum(p * ref.rms_norm(ref.glu_ffn(latent, params["w_gate"][j], params["w_up"][j], params["w_down"][j],
                                             "situ_glu"), params["latent_norm"])
                for p, j in zip(weights[t], expert_idx[t]))
        y[t] = u @ params["w_up_proj"]
        if "shared_gate" in params:
            y[t] += ref.glu_ffn(x[t], params["shared_gate"], params["shared_up"], params["shared_down"], "situ_glu")
    return y


def in_float32(x, params, top_k):
    return ref.moe_forward(x, params, top_k, activation="situ_glu").astype(np.float32)


WRONG = {"02.latent_moe_forward_numpy": [swiglu_experts, without_the_latent_norm, norm_per_expert, in_float32]}
