"""Plausible wrong answers for chapter 11 (the assembled K3)."""

import torch

from k3course.layers.residual import block_attnres_read
from k3course.model import K3Model, sample_next


def schedule_mla_first(n_layers, kda_per_mla, first_k_dense):
    """MLA at i % (r + 1) == 0: the first layer of each group instead of the last."""
    period = kda_per_mla + 1
    mixers = tuple("mla" if kda_per_mla == 0 or i % period == 0 else "kda" for i in range(n_layers))
    return mixers, tuple("dense" if i < first_k_dense else "moe" for i in range(n_layers))


def schedule_last_layer_not_forced(n_layers, kda_per_mla, first_k_dense):
    """Forgets that the last layer is always MLA."""
    period = kda_per_mla + 1
    mixers = tuple("mla" if kda_per_mla == 0 or (i + 1) % period == 0 else "kda" for i in range(n_layers))
    return mixers, tuple("dense" if i < first_k_dense else "moe" for i in range(n_layers))


def schedule_one_dense_too_many(n_layers, kda_per_mla, first_k_dense):
    """Dense for i <= first_k_dense."""
    period = kda_per_mla + 1
    mixers = tuple("mla" if kda_per_mla == 0 or (i + 1) % period == 0 or i == n_layers - 1 else "kda"
                   for i in range(n_layers))
    return mixers, tuple("dense" if i <= first_k_dense else "moe" for i in range(n_layers))


def layer_ffn_reads_before_the_mixer_writes(embedding, outputs, queries, block_size, mixer, ffn, mixer_norm,
                                            ffn_norm):
    """Both sub-layers read the same sources: the FFN does not see the mixer's output."""
    a = mixer(mixer_norm(block_attnres_read(embedding, outputs, queries[0], block_size)))
    f = ffn(ffn_norm(block_attnres_read(embedding, outputs, queries[1], block_size)))
    return a, f


def layer_queries_swapped(embedding, outputs, queries, block_size, mixer, ffn, mixer_norm, ffn_norm):
    """The FFN's query used for the mixer's read and vice versa."""
    a = mixer(mixer_norm(block_attnres_read(embedding, outputs, queries[1], block_size)))
    f = ffn(ffn_norm(block_attnres_read(embedding, [*outputs, a], queries[0], block_size)))
    return a, f


def layer_norm_after_the_sublayer(embedding, outputs, queries, block_size, mixer, ffn, mixer_norm, ffn_norm):
    """PostNorm: the norm applied to the sub-layer's output instead of its input."""
    a = mixer_norm(mixer(block_attnres_read(embedding, outputs, queries[0], block_size)))
    f = ffn_norm(ffn(block_attnres_read(embedding, [*outputs, a], queries[1], block_size)))
    return a, f


def cache_concatenates(buffer, length, rows):
    """torch.cat onto the filled part: a new tensor every token, the preallocated buffer never written."""
    return torch.cat([buffer[:, :length], rows], dim=1), length + rows.shape[1]


def cache_grows_to_exactly_what_fits(buffer, length, rows):
    """Grows to length + T, not by doubling: one reallocation per decoded token once full."""
    end = length + rows.shape[1]
    if end > buffer.shape[1]:
        grown = buffer.new_zeros(buffer.shape[0], end, buffer.shape[2])
        grown[:, :length] = buffer[:, :length]
        buffer = grown
    buffer[:, length:end] = rows
    return buffer, end


def cache_never_grows(buffer, length, rows):
    """Writes into the buffer and trusts it has room."""
    buffer[:, length:length + rows.shape[1]] = rows
    return buffer, length + rows.shape[1]


def count_every_expert_as_active(cfg):
    total = sum(p.numel() for p in K3Model.from_config(cfg, device="meta").parameters())
    return total, total


def count_buffers_too(cfg):
    """state_dict holds the MoE bias buffers as well as the parameters."""
    model = K3Model.from_config(cfg, device="meta")
    total = sum(t.numel() for t in model.state_dict().values())
    return total, sum(active for _, active in model.param_breakdown().values())


def cache_doubles_the_length_not_the_capacity(buffer, length, rows):
    """Grows to max(length + T, 2·length): the same as 2·capacity whenever the cache was full."""
    end = length + rows.shape[1]
    if end > buffer.shape[1]:
        grown = buffer.new_zeros(buffer.shape[0], max(end, 2 * length), buffer.shape[2])
        grown[:, :length] = buffer[:, :length]
        buffer = grown
    buffer[:, length:end] = rows
    return buffer, end


def cache_grows_in_the_default_dtype(buffer, length, rows):
    """Grows with torch.zeros(...) and no dtype: torch.cat promotes a grown bf16 cache to float32."""
    batch, capacity, width = buffer.shape
    end = length + rows.shape[1]
    if end > capacity:
        padding = torch.zeros(batch, max(end, 2 * capacity) - length, width)
        buffer = torch.cat([buffer[:, :length], padding], dim=1)
    buffer[:, length:end] = rows
    return buffer, end


def count_with_the_ratios_layer_plan(cfg):
    """Counts the model that the ratio kda_per_mla describes, as if the config had no explicit mla_layers."""
    breakdown = K3Model.from_config(cfg.replace(mla_layers=None), device="meta").param_breakdown()
    return sum(total for total, _ in breakdown.values()), sum(active for _, active in breakdown.values())



def count_active_per_moe_layer(cfg):
    """One MoE layer's routed experts, the share of them a token uses, times the MoE layers: a division by zero when
    every FFN is dense."""
    model = K3Model.from_config(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".ffn.experts." in name)
    per_layer = routed // cfg.n_moe_layers
    return total, total - routed + cfg.n_moe_layers * (per_layer // cfg.n_routed_experts * cfg.top_k)

def sample_top_k_over_the_batch(logits, temperature, top_k, generator):
    """torch.topk(..., dim=0): the k-th largest of each column (over the rows), not of each row's vocabulary."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=0).values[-1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def sample_from_the_logits(logits, temperature, top_k, generator):
    """torch.multinomial wants non-negative weights: the logits clipped at 0 are used as weights, not softmax."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.clamp_min(0), 1, generator=generator)


def sample_temperature_multiplies(logits, temperature, top_k, generator):
    """logits · temperature: a hot temperature sharpens the distribution instead of flattening it."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() * temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def generate_without_the_cache(model, tokens, max_new_tokens, temperature, top_k, seed):
    """Runs the whole sequence so far through the model every step: right tokens, quadratic cost."""
    generator = None if seed is None else torch.Generator(tokens.device).manual_seed(seed)
    sequence = tokens
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _, _ = model(sequence)
            sequence = torch.cat([sequence, sample_next(logits[:, -1], temperature, top_k, generator)], dim=1)
    return sequence


def generate_prompt_again_into_the_cache(model, tokens, max_new_tokens, temperature, top_k, seed):
    """Keeps one cache but feeds it the prompt and every token so far each step: the cache holds them again and
    again."""
    generator = None if seed is None else torch.Generator(tokens.device).manual_seed(seed)
    cache, sequence = model.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens), tokens
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _, cache = model(sequence, cache)
            sequence = torch.cat([sequence, sample_next(logits[:, -1], temperature, top_k, generator)], dim=1)
    return sequence


def generate_reseeds_every_step(model, tokens, max_new_tokens, temperature, top_k, seed):
    """A fresh generator from the seed at every step: each step draws the same random number."""
    cache, step_input, out = model.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens), tokens, [tokens]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            generator = None if seed is None else torch.Generator(tokens.device).manual_seed(seed)
            logits, _, cache = model(step_input, cache)
            step_input = sample_next(logits[:, -1], temperature, top_k, generator)
            out.append(step_input)
    return torch.cat(out, dim=1)


def sample_top_k_by_index(logits, temperature, top_k, generator):
    """Keeps exactly the k indices torch.topk returns: of several logits tied with the k-th, some are dropped."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kept = torch.topk(logits, top_k, dim=-1).indices
        logits = torch.full_like(logits, float("-inf")).scatter(-1, kept, logits.gather(-1, kept))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def sample_softmax_in_the_logits_dtype(logits, temperature, top_k, generator):
    """The softmax in bf16 for bf16 logits: probabilities rounded to 8 bits move the draws."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1).float(), 1, generator=generator)


def sample_divides_in_the_logits_dtype(logits, temperature, top_k, generator):
    """Divides by the temperature in bf16 and casts after: logits / 0.7 rounded to 8 bits move the draws (a
    power-of-two temperature divides exactly, so only another one shows it)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = (logits / temperature).float()
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def sample_temperature_floored(logits, temperature, top_k, generator):
    """temperature 0 as a tiny temperature: the right token, but a draw from the generator the greedy path never
    makes."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def _cached_loop(model, tokens, max_new_tokens, temperature, top_k, generator):
    """The right prefill-then-decode loop, whatever mode the model is in."""
    cache, step_input, out = model.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens), tokens, [tokens]
    for _ in range(max_new_tokens):
        logits, _, cache = model(step_input, cache)
        step_input = sample_next(logits[:, -1], temperature, top_k, generator)
        out.append(step_input)
    return torch.cat(out, dim=1)


def _seeded(seed, tokens):
    return None if seed is None else torch.Generator(tokens.device).manual_seed(seed)


def generate_in_training_mode(model, tokens, max_new_tokens, temperature, top_k, seed):
    """Never switches to eval mode: a model handed in training runs its MoE layers in training, which adds the
    generated tokens to the routing record the next bias update reads."""
    with torch.no_grad():
        return _cached_loop(model, tokens, max_new_tokens, temperature, top_k, _seeded(seed, tokens))


def generate_leaves_the_model_in_eval_mode(model, tokens, max_new_tokens, temperature, top_k, seed):
    """model.eval() and never back: the caller's training loop goes on in eval mode (no bias updates)."""
    model.eval()
    with torch.no_grad():
        return _cached_loop(model, tokens, max_new_tokens, temperature, top_k, _seeded(seed, tokens))


def generate_seeds_the_global_rng(model, tokens, max_new_tokens, temperature, top_k, seed):
    """torch.manual_seed(seed) instead of a generator of its own: the same draws, but the caller's global RNG is
    reset."""
    was_training = model.training
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = _cached_loop(model, tokens, max_new_tokens, temperature, top_k, None)
    model.train(was_training)
    return out


def generate_under_inference_mode(model, tokens, max_new_tokens, temperature, top_k, seed):
    """torch.inference_mode() where no_grad belongs: the tokens come back as inference tensors, which autograd
    refuses later (train on them: "Inference tensors cannot be saved for backward")."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        out = _cached_loop(model, tokens, max_new_tokens, temperature, top_k, _seeded(seed, tokens))
    model.train(was_training)
    return out



def generate_prefills_all_but_the_last(model, tokens, max_new_tokens, temperature, top_k, seed):
    """Prefills tokens[:, :-1], then feeds the last prompt token as the first decode step: the same positions, but
    a one-token prompt makes an empty prefill."""
    was_training = model.training
    model.eval()
    generator, out = _seeded(seed, tokens), [tokens]
    cache = model.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens)
    with torch.no_grad():
        if max_new_tokens:
            _, _, cache = model(tokens[:, :-1], cache)
        step_input = tokens[:, -1:]
        for _ in range(max_new_tokens):
            logits, _, cache = model(step_input, cache)
            step_input = sample_next(logits[:, -1], temperature, top_k, generator)
            out.append(step_input)
    model.train(was_training)
    return torch.cat(out, dim=1)


def generate_samples_at_temperature_0(model, tokens, max_new_tokens, temperature, top_k, seed):
    """Greedy as sampling at a tiny temperature: the argmax tokens, but each step draws a random number, from the
    caller's global RNG when seed is None."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = _cached_loop(model, tokens, max_new_tokens, max(temperature, 1e-6), top_k, _seeded(seed, tokens))
    model.train(was_training)
    return out

def generate_calls_model_generate(model, tokens, max_new_tokens, temperature, top_k, seed):
    """The package's model.generate, which the exercise asks you to write."""
    return model.generate(tokens, max_new_tokens, temperature, top_k, seed)


WRONG = {
    "11.layer_schedule": [schedule_mla_first, schedule_last_layer_not_forced, schedule_one_dense_too_many],
    "11.decoder_layer": [layer_ffn_reads_before_the_mixer_writes, layer_queries_swapped,
                         layer_norm_after_the_sublayer],
    "11.cache_write": [cache_concatenates, cache_grows_to_exactly_what_fits, cache_never_grows,
                    cache_doubles_the_length_not_the_capacity, cache_grows_in_the_default_dtype],
    "11.param_count": [count_every_expert_as_active, count_buffers_too, count_with_the_ratios_layer_plan,
                       count_active_per_moe_layer],
    "11.sample_next": [sample_top_k_over_the_batch, sample_from_the_logits, sample_temperature_multiplies,
                       sample_top_k_by_index, sample_softmax_in_the_logits_dtype, sample_temperature_floored,
                       sample_divides_in_the_logits_dtype],
    "11.generate": [generate_without_the_cache, generate_prompt_again_into_the_cache, generate_reseeds_every_step,
                    generate_in_training_mode, generate_leaves_the_model_in_eval_mode, generate_seeds_the_global_rng,
                    generate_under_inference_mode, generate_calls_model_generate, generate_prefills_all_but_the_last,
                    generate_samples_at_temperature_0],
}
