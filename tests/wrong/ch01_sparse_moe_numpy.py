"""Plausible wrong answers for chapter 01's NumPy rung."""

import numpy as np

from k3course.reference import moe as ref


def _shared(x, params):
    return ref.glu_ffn(x, params["shared_gate"], params["shared_up"], params["shared_down"])


def shared_experts_added_twice(x, params, top_k):
    """Adds the shared experts once inside the token loop and once more at the end."""
    y = ref.moe_forward(x, params, top_k)
    return y + _shared(x, params) if "shared_gate" in params else y


def weights_from_biased_scores(x, params, top_k):
    """Weights the chosen experts with s + b instead of the unbiased s."""
    scores = ref.sigmoid(x @ params["router"]) + params["bias"]
    y = _shared(x, params) if "shared_gate" in params else np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = ref.top_indices(scores[t], top_k)
        weights = scores[t, chosen] / scores[t, chosen].sum()
        for p, j in zip(weights, chosen):
            y[t] += p * ref.glu_ffn(x[t], params["w_gate"][j], params["w_up"][j], params["w_down"][j])
    return y


def without_renormalising(x, params, top_k):
    """Forgets to divide the chosen scores by their sum."""
    return ref.moe_forward(x, params, top_k, renormalize=False)


def in_float32(x, params, top_k):
    """Right formula, returned in float32 where float64 was asked."""
    return ref.moe_forward(x, params, top_k).astype(np.float32)


def through_torch(x, params, top_k):
    """Right formula, computed in torch: the NumPy rung refuses it."""
    import torch

    return ref.moe_forward(torch.from_numpy(x).mul(1).numpy(), params, top_k)


WRONG = {"01.moe_forward_numpy": [shared_experts_added_twice, weights_from_biased_scores, without_renormalising,
                                  in_float32, through_torch]}
