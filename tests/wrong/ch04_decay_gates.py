"""Plausible wrong answers for chapter 04."""

import torch


def decay_after_write(state, q, k, v, g):
    """Decays the new write too: S_t = α (S + k vᵀ)."""
    alpha = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    state = alpha * (state + k.unsqueeze(-1) * v.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def read_before_write(state, q, k, v, g):
    """Reads the output from the decayed old state, before adding k vᵀ."""
    alpha = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    decayed = alpha * state
    return torch.einsum("bhkv,bhk->bhv", decayed, q), decayed + k.unsqueeze(-1) * v.unsqueeze(-2)


def parallel_exclusive_cumsum(q, k, v, g, scale=None):
    """Exclusive instead of inclusive cumulative decay: G_t = Σ_{s<t} g_s."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand_as(q)
    G = (g.cumsum(1) - g).transpose(1, 2)
    T = q.shape[1]
    w = torch.exp((G.unsqueeze(3) - G.unsqueeze(2)).clamp(max=0)) * torch.ones(T, T).tril()[..., None].bool()
    s = torch.einsum("bhtd,bhsd,bhtsd->bhts", (q * scale).transpose(1, 2), k.transpose(1, 2), w)
    return (s @ v.transpose(1, 2)).transpose(1, 2)


def parallel_without_decay_mask(q, k, v, g, scale=None):
    """Causal linear attention that forgets the decay."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bthd,bshd->bhts", q * scale, k).tril()
    return (s @ v.transpose(1, 2)).transpose(1, 2)


def _over_time(step, q, k, v, gates, scale, initial_state, output_final_state):
    """The package's one-token step (an earlier exercise, allowed) looped over time, q times ``scale``."""
    batch, time, heads, key_dim = q.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(time):
        o_t, state = step(state, (scale * q[:, t]).float(), k[:, t].float(), v[:, t].float(),
                          *(x[:, t].float() for x in gates))
        outputs.append(o_t)
    return torch.stack(outputs, 1).to(q.dtype), (state if output_final_state else None)


def recurrent_without_scale(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Forgets to scale the queries by K^-1/2."""
    from k3course.ops.recurrent import decay_step

    return _over_time(decay_step, q, k, v, (g,), 1.0 if scale is None else scale, initial_state, output_final_state)


def recurrent_ignoring_initial_state(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Starts from zeros whatever initial_state says."""
    from k3course.ops.recurrent import decay_step

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _over_time(decay_step, q, k, v, (g,), scale, None, output_final_state)


def step_in_place(state, q, k, v, g):
    """The right step, computed into the caller's state in place."""
    alpha = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    state.mul_(alpha).add_(k.unsqueeze(-1) * v.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def step_in_float32(state, q, k, v, g):
    """Casts everything to float32."""
    state, q, k, v, g = (x.float() for x in (state, q, k, v, g))
    alpha = g.exp()[..., None, None] if g.dim() == 2 else g.exp()[..., None]
    state = alpha * state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def parallel_factored_decay(q, k, v, g, scale=None):
    """(Q ⊙ e^G)(K ⊙ e^{−G})ᵀ: one matmul, exact in theory, inf · 0 = NaN once −G passes 88 in fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand_as(q)
    G = g.cumsum(1)
    s = torch.einsum("bthd,bshd->bhts", q * scale * G.exp(), k * torch.exp(-G)).tril()
    return (s @ v.transpose(1, 2)).transpose(1, 2)


def recurrent_updates_initial_state_in_place(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Starts from initial_state itself (no copy) and updates it in place: the caller's tensor changes."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = torch.zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(T):
        alpha = g[:, t].exp()[..., None, None] if g.dim() == 3 else g[:, t].exp()[..., None]
        state.mul_(alpha).add_(k[:, t].float().unsqueeze(-1) * v[:, t].float().unsqueeze(-2))
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t].float() * scale))
    return torch.stack(outputs, 1).to(q.dtype), (state if output_final_state else None)


def recurrent_state_in_input_dtype(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Runs the whole recurrence in the input dtype: a bfloat16 state (fla and the package keep it float32)."""
    from k3course.ops.recurrent import decay_step

    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    state = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        o_t, state = decay_step(state, q[:, t] * scale, k[:, t], v[:, t], g[:, t])
        outputs.append(o_t)
    return torch.stack(outputs, 1), (state if output_final_state else None)


WRONG = {
    "04.decay_step": [decay_after_write, read_before_write, step_in_place, step_in_float32],
    "04.decay_attention_parallel": [parallel_exclusive_cumsum, parallel_without_decay_mask, parallel_factored_decay],
    "04.gla_recurrent": [recurrent_without_scale, recurrent_ignoring_initial_state,
                         recurrent_updates_initial_state_in_place, recurrent_state_in_input_dtype],
}

# What the check's message says, for the wrong answers the grader knows the step of (tests/test_grading.py).
POINTED = {
    recurrent_without_scale: "wrong with the default scale: scale=None means K^{-1/2}",
    recurrent_ignoring_initial_state: "wrong with an initial state: start the loop from initial_state",
}
