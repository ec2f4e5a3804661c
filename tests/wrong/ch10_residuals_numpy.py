"""Plausible wrong answers for chapter 10's NumPy rung."""

import numpy as np

from k3course.reference import attnres as ref


def _stack(embedding, sublayers, queries, block_size, read):
    outputs, inputs = [], []
    for index, sublayer in enumerate(sublayers):
        inputs.append(read(embedding, outputs, queries[index], block_size))
        outputs.append(sublayer(inputs[-1]))
    return read(embedding, outputs, queries[len(sublayers)], block_size), inputs


def _sources(embedding, outputs, block_size):
    return [embedding, *outputs] if block_size is None else ref.block_sources(embedding, outputs, block_size)


def _softmax_read(embedding, outputs, query, block_size, keys, axis):
    sources = np.stack(_sources(embedding, outputs, block_size))  # [N, T, D]
    logits = keys(sources) @ query  # [N, T]
    weights = np.exp(logits - logits.max(axis, keepdims=True))
    weights /= weights.sum(axis, keepdims=True)
    return np.einsum("nt,ntd->td", weights, sources)


def keys_not_normalised(embedding, sublayers, queries, block_size=None):
    """Scores wᵀ v_i on the raw sources, without the RMSNorm."""
    return _stack(embedding, sublayers, queries, block_size,
                  lambda e, o, w, b: _softmax_read(e, o, w, b, lambda s: s, 0))


def softmax_over_tokens(embedding, sublayers, queries, block_size=None):
    """Normalises the weights over the tokens (axis 1) instead of over the sources (depth)."""
    return _stack(embedding, sublayers, queries, block_size,
                  lambda e, o, w, b: _softmax_read(e, o, w, b, ref.rms_norm, 1))


def partial_block_left_out(embedding, sublayers, queries, block_size=None):
    """Block AttnRes that reads only completed blocks: the current block's partial sum is never a source."""
    def read(e, o, w, b):
        size = 1 if b is None else b
        done = len(o) - len(o) % size
        return ref.depth_attention(w, ref.block_sources(e, o[:done], size))[0]

    return _stack(embedding, sublayers, queries, block_size, read)


def no_final_read(embedding, sublayers, queries, block_size=None):
    """Returns the last sub-layer's output plus its input, instead of one more depth read."""
    _, inputs = ref.run_stack(embedding, sublayers, queries, block_size)
    return inputs[-1] + sublayers[-1](inputs[-1]), inputs


WRONG = {"10.attnres_stack_numpy": [keys_not_normalised, softmax_over_tokens, partial_block_left_out, no_final_read]}
