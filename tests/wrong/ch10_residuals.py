"""Plausible wrong answers for chapter 10 (attention residuals)."""

import torch
import torch.nn.functional as F


def _keys(sources):
    return F.rms_norm(sources, (sources.shape[-1],), eps=1e-6)


def depth_softmax_over_tokens(query, sources):
    """Softmax over the token axis instead of over depth."""
    weights = torch.softmax(_keys(sources) @ query, dim=-1)
    return torch.einsum("nbt,nbtd->btd", weights, sources), weights


def depth_no_key_norm(query, sources):
    """Raw sources as keys: large outputs dominate."""
    weights = torch.softmax(sources @ query, dim=0)
    return torch.einsum("nbt,nbtd->btd", weights, sources), weights


def depth_scaled_by_sqrt_d(query, sources):
    """Adds the 1/sqrt(d) of token attention (AttnRes has none)."""
    weights = torch.softmax(_keys(sources) @ query / sources.shape[-1] ** 0.5, dim=0)
    return torch.einsum("nbt,nbtd->btd", weights, sources), weights


def sources_zero_partial(embedding, outputs, block_size):
    """Always appends the partial sum, even when the current block is still empty."""
    completed = len(outputs) // block_size * block_size
    sums = [torch.stack(outputs[i:i + block_size]).sum(0) for i in range(0, completed, block_size)]
    partial = sum(outputs[completed:], torch.zeros_like(embedding))
    return torch.stack([embedding, *sums, partial])


def sources_every_output(embedding, outputs, block_size):
    """Ignores the blocks: Full AttnRes sources."""
    return torch.stack([embedding, *outputs])


def sources_embedding_in_first_block(embedding, outputs, block_size):
    """Adds the embedding into the first block's sum instead of keeping it apart."""
    sums = [torch.stack(outputs[i:i + block_size]).sum(0) for i in range(0, len(outputs), block_size)]
    if sums:
        sums[0] = sums[0] + embedding
        return torch.stack(sums)
    return embedding[None]


def read_standard_residual(embedding, outputs, query, block_size):
    """The standard residual stream: embedding plus every output."""
    return embedding + sum(outputs, torch.zeros_like(embedding))


def read_uniform_average(embedding, outputs, query, block_size):
    """Ignores the query: the zero-initialised average."""
    from k3course.layers.residual import block_sources

    return block_sources(embedding, outputs, block_size).mean(0)


def read_full_attnres(embedding, outputs, query, block_size):
    """Attends over every output separately (Full AttnRes), not over block sums."""
    from k3course.layers.residual import depth_attention

    return depth_attention(query, torch.stack([embedding, *outputs]))[0]



def depth_softmax_without_max(query, sources):
    """softmax over depth as e^s / Σ e^s: inf / inf = NaN for a large query."""
    e = torch.exp(_keys(sources) @ query)
    weights = e / e.sum(0, keepdim=True)
    return torch.einsum("nbt,nbtd->btd", weights, sources), weights


def sources_sum_into_first_output(embedding, outputs, block_size):
    """Accumulates each block into its first output (total = block[0]; total += ...): changes the caller's list."""
    sources = [embedding]
    for start in range(0, len(outputs), block_size):
        block = outputs[start:start + block_size]
        total = block[0]
        for output in block[1:]:
            total += output
        sources.append(total)
    return torch.stack(sources)


def read_in_float32(embedding, outputs, query, block_size):
    """The right read (the package's earlier pieces), cast to float32."""
    from k3course.layers.residual import block_sources, depth_attention

    sources = block_sources(embedding.float(), [o.float() for o in outputs], block_size)
    return depth_attention(query.float(), sources)[0]


WRONG = {
    "10.depth_attention": [depth_softmax_over_tokens, depth_no_key_norm, depth_scaled_by_sqrt_d,
                           depth_softmax_without_max],
    "10.block_sources": [sources_zero_partial, sources_every_output, sources_embedding_in_first_block,
                         sources_sum_into_first_output],
    "10.block_attnres_read": [read_standard_residual, read_uniform_average, read_full_attnres, read_in_float32],
}
