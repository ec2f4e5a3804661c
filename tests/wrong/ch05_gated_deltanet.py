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


def _over_time(q, k, v, g, beta, scale, initial_state, output_final_state):
    """The package's gdn_step (an earlier exercise, allowed) looped over time, q times ``scale``."""
    from k3course.ops.recurrent import gdn_step

    batch, time, heads, key_dim = q.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(time):
        o_t, state = gdn_step(state, *(x[:, t].float() for x in (scale * q, k, v, g, beta)))
        outputs.append(o_t)
    return torch.stack(outputs, 1).to(q.dtype), (state if output_final_state else None)


def recurrent_without_scale(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Forgets to scale the queries by K^-1/2."""
    return _over_time(q, k, v, g, beta, 1.0 if scale is None else scale, initial_state, output_final_state)


def recurrent_ignoring_initial_state(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Starts from zeros whatever initial_state says."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _over_time(q, k, v, g, beta, scale, None, output_final_state)


def delta_in_place(state, q, k, v, beta):
    """The right update, added to the caller's state in place (state += ...)."""
    error = v - _read(state, k)
    state += _outer(beta.unsqueeze(-1) * k, error)
    return _read(state, q), state


def delta_normalises_keys(state, q, k, v, beta):
    """Normalises k "because KDA does": right for unit keys only (the layer normalises, not the rule)."""
    k = torch.nn.functional.normalize(k, dim=-1)
    error = v - _read(state, k)
    state = state + _outer(beta.unsqueeze(-1) * k, error)
    return _read(state, q), state


def gdn_step_in_float32(state, q, k, v, g, beta):
    """Casts everything to float32."""
    state, q, k, v, g, beta = (x.float() for x in (state, q, k, v, g, beta))
    decayed = g.exp()[..., None, None] * state
    state = decayed + _outer(beta.unsqueeze(-1) * k, v - _read(decayed, k))
    return _read(state, q), state


def recurrent_state_in_input_dtype(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Runs the recurrence in the input dtype: a bfloat16 state (fla and the package keep it float32)."""
    from k3course.ops.recurrent import gdn_step

    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        o_t, state = gdn_step(state, q[:, t] * scale, k[:, t], v[:, t], g[:, t], beta[:, t])
        outputs.append(o_t)
    return torch.stack(outputs, 1), (state if output_final_state else None)


WRONG = {
    "05.delta_step": [delta_without_error, delta_beta_on_value_only, delta_in_place, delta_normalises_keys],
    "05.gdn_step": [gdn_decay_after_update, gdn_error_against_undecayed_state, gdn_step_in_float32],
    "05.gdn_recurrent": [recurrent_without_scale, recurrent_ignoring_initial_state, recurrent_state_in_input_dtype],
}

# What the check's message says, for the wrong answers the grader knows the step of (tests/test_grading.py).
POINTED = {
    recurrent_without_scale: "wrong with the default scale: scale=None means K^{-1/2}",
    recurrent_ignoring_initial_state: "wrong with an initial state: start the loop from initial_state",
    gdn_decay_after_update: "wrong with no incoming state (S = 0) under a decay: decay the old state first",
    gdn_error_against_undecayed_state: "wrong with a state, a decay and a write together: the correction reads "
                                       "the decayed state",
}
