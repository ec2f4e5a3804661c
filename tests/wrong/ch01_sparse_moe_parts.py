"""Plausible wrong answers for chapter 01's shared experts."""

import torch.nn.functional as F

from k3course.moe.experts import glu_ffn


def swiglu_whatever_asked(x, w_gate, w_up, w_down, activation):
    """Always SwiGLU: K3's shared expert uses SiTU-GLU."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def activation_on_the_wrong_branch(x, w_gate, w_up, w_down, activation):
    """Feeds x W_u to the gate side and x W_g to the up side."""
    return glu_ffn(x, w_up, w_gate, w_down, activation)


def shared_experts_added_twice(x, w_gate, w_up, w_down, activation):
    """Two shared experts fused into one FFN, counted once more on top."""
    return 2 * glu_ffn(x, w_gate, w_up, w_down, activation)


def computed_and_returned_in_float32(x, w_gate, w_up, w_down, activation):
    return glu_ffn(x.float(), w_gate.float(), w_up.float(), w_down.float(), activation)


def right_answer_in_place_on_x(x, w_gate, w_up, w_down, activation):
    """Scales x in place for a moment and forgets to undo it (the caller's tokens change)."""
    x.mul_(1.0 + 2 ** -10)
    return glu_ffn(x, w_gate, w_up, w_down, activation)


WRONG = {"01.shared_experts": [swiglu_whatever_asked, activation_on_the_wrong_branch, shared_experts_added_twice,
                               computed_and_returned_in_float32, right_answer_in_place_on_x]}
