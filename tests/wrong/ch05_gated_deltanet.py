"""Plausible wrong answers for chapter 05."""

import torch


def _read(state, x):
    return torch.einsum("bhkv,bhk->bhv", state, x)


def _outer(k, v):
    return k.unsqueeze(-1) * v.unsqueeze(-2)


def delta_without_error(state, q, k, v, beta):
    """Writes β k vᵀ like linear attention, never subtracting what the state predicted."""
    state = state + _outer(beta.unsqueeze(-1) * k, v)
    return _read(state, q), state


def delta_beta_on_value_only(state, q, k, v, beta):
    """Scales v by β but subtracts the full prediction: S + k (β v − Sᵀk)ᵀ."""
    state = state + _outer(k, beta.unsqueeze(-1) * v - _read(state, k))
    return _read(state, q), state


def gdn_decay_after_update(state, q, k, v, g, beta):
    """Delta update against the old state, then decay: α[(I − β k kᵀ) S + β k vᵀ]."""
    state = state + _outer(beta.unsqueeze(-1) * k, v - _read(state, k))
    state = g.exp()[..., None, None] * state
    return _read(state, q), state


def gdn_error_against_undecayed_state(state, q, k, v, g, beta):
    """Decays S but computes the error with the undecayed state."""
    error = v - _read(state, k)
    state = g.exp()[..., None, None] * state + _outer(beta.unsqueeze(-1) * k, error)
    return _read(state, q), state


def recurrent_without_scale(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    from k3course.attention.recurrent import gdn_recurrent

    return gdn_recurrent(q, k, v, g, beta, scale=1.0, initial_state=initial_state,
                         output_final_state=output_final_state)


def recurrent_ignoring_initial_state(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    from k3course.attention.recurrent import gdn_recurrent

    return gdn_recurrent(q, k, v, g, beta, scale=scale, output_final_state=output_final_state)


WRONG = {
    "05.delta_step": [delta_without_error, delta_beta_on_value_only],
    "05.gdn_step": [gdn_decay_after_update, gdn_error_against_undecayed_state],
    "05.gdn_recurrent": [recurrent_without_scale, recurrent_ignoring_initial_state],
}
