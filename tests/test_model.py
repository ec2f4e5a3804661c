"""The assembled K3: its module tree is the config's accounting, cached decoding equals the full forward,
every parameter learns, and bad input is named."""

from __future__ import annotations

import pytest
import torch
from helpers import devices_computed_on

from k3course import accounting
from k3course.config import K3Config
from k3course.model import IGNORE, K3Cache, K3Model
from k3course.params import is_decayed, is_forget_gate, is_residual_output, no_weight_decay, residual_output

SCHEDULES = {"hybrid": {}, "all-kda": dict(mla_layers=()), "all-mla": dict(kda_per_mla=0)}
PROMPTS = (1, 63, 64, 65, 130)


def tiny_model(seed: int = 0, **changes) -> K3Model:
    torch.manual_seed(seed)
    return K3Model.from_config(K3Config.preset("tiny").replace(**changes)).eval()


def decode_logits(model: K3Model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill tokens[:, :prompt] into a fresh cache, then feed the rest one token at a time (the cache is made
    for fewer tokens than come, so the MLA caches also grow)."""
    cache = model.new_cache(tokens.shape[0], prompt + 1)
    logits, _, cache = model(tokens[:, :prompt], cache)
    steps = [logits]
    for t in range(prompt, tokens.shape[1]):
        logits, _, cache = model(tokens[:, t:t + 1], cache)
        steps.append(logits)
    assert cache.length == tokens.shape[1]
    return torch.cat(steps, dim=1)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", ["kimi-k3", "kimi-k2", "deepseek-v3", "kimi-linear-48b"])
def test_reference_models_build_on_meta_with_exactly_the_accounted_parameters(name):
    cfg = K3Config.preset(name)
    model, devices = devices_computed_on(lambda: K3Model.from_config(cfg, device="meta"))
    assert devices == {"meta"}, "nothing allocated or initialised for real"
    count = accounting.param_count(cfg)
    assert sum(p.numel() for p in model.parameters()) == count.total
    assert sum(active for _, active in model.param_breakdown().values()) == count.active
    assert [layer.mixer_kind for layer in model.layers] == list(cfg.layer_types())
    assert [layer.ffn_kind for layer in model.layers] == list(cfg.ffn_types())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_then_decode_equals_the_full_forward(schedule, batch):
    model = tiny_model(**SCHEDULES[schedule])
    tokens = torch.randint(0, 256, (batch, 134), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _, _ = model(tokens)
        for prompt in PROMPTS:
            decoded = decode_logits(model, tokens[:, :prompt + 4], prompt)  # prefill, then 4 decode steps
            assert relative_error(decoded, full[:, :prompt + 4]) <= 1e-4, f"prompt {prompt}"


def test_an_fp64_model_computes_and_caches_in_fp64():
    model = tiny_model().double()
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _, _ = model(tokens)
        decoded = decode_logits(model, tokens, 65)
    assert full.dtype == decoded.dtype == torch.float64
    assert relative_error(decoded, full) <= 1e-10  # fp32 anywhere inside would leave ~1e-7
    cache = model.new_cache(2, 8)
    assert all(tensor.dtype == torch.float64 for layer in cache.layers for tensor in vars(layer).values()
               if isinstance(tensor, torch.Tensor) and tensor.is_floating_point())


def test_decode_equals_forward_on_the_triton_path(monkeypatch):
    monkeypatch.setenv("K3COURSE_KERNELS", "triton")
    model = tiny_model(seed=2)
    tokens = torch.randint(0, 256, (3, 67), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _, _ = model(tokens)
        for prompt in (1, 65):
            decoded = decode_logits(model, tokens[:, :prompt + 2], prompt)
            assert relative_error(decoded, full[:, :prompt + 2]) <= 1e-4, f"prompt {prompt}"


def test_decoding_takes_the_recurrent_step_and_the_absorbed_form():
    model = tiny_model()
    kda, mla = model.layers[0].mixer, model.layers[-1].mixer
    assert not kda.uses_chunked_op(1) and kda.uses_chunked_op(65)
    assert mla.uses_absorbed(1) and not mla.uses_absorbed(65)
    model.train()
    assert kda.uses_chunked_op(1) and not mla.uses_absorbed(1)  # training always takes the chunked, naive form


def test_one_backward_reaches_every_parameter_with_finite_gradients():
    model = tiny_model().train()
    tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(4))
    _, loss, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # an untrained model is near uniform
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} gets no gradient"


# The tiny preset (layers 0-2 KDA, layer 3 MLA; layer 0's FFN dense): the parameters marked no_weight_decay,
# and the residual outputs (the scaled initialisation).
TINY_NO_DECAY = [
    "layers.0.mixer_norm.weight", "layers.0.mixer.o_norm_weight", "layers.0.mixer.A_log", "layers.0.mixer.dt_bias",
    "layers.0.mixer.q_conv.weight", "layers.0.mixer.k_conv.weight", "layers.0.mixer.v_conv.weight",
    "layers.0.ffn_norm.weight", "layers.1.mixer_norm.weight", "layers.1.mixer.o_norm_weight",
    "layers.1.mixer.A_log", "layers.1.mixer.dt_bias", "layers.1.mixer.q_conv.weight",
    "layers.1.mixer.k_conv.weight", "layers.1.mixer.v_conv.weight", "layers.1.ffn_norm.weight",
    "layers.1.ffn.latent_norm", "layers.2.mixer_norm.weight", "layers.2.mixer.o_norm_weight",
    "layers.2.mixer.A_log", "layers.2.mixer.dt_bias", "layers.2.mixer.q_conv.weight",
    "layers.2.mixer.k_conv.weight", "layers.2.mixer.v_conv.weight", "layers.2.ffn_norm.weight",
    "layers.2.ffn.latent_norm", "layers.3.mixer_norm.weight", "layers.3.mixer.q_norm.weight",
    "layers.3.mixer.kv_norm.weight", "layers.3.ffn_norm.weight", "layers.3.ffn.latent_norm", "residual.queries",
    "final_norm.weight"]
TINY_RESIDUAL_OUTPUTS = [
    "layers.0.mixer.o_proj.weight", "layers.0.ffn.down", "layers.1.mixer.o_proj.weight", "layers.1.ffn.up_proj",
    "layers.1.ffn.experts.down", "layers.1.ffn.shared.down", "layers.2.mixer.o_proj.weight", "layers.2.ffn.up_proj",
    "layers.2.ffn.experts.down", "layers.2.ffn.shared.down", "layers.3.mixer.out.weight", "layers.3.ffn.up_proj",
    "layers.3.ffn.experts.down", "layers.3.ffn.shared.down"]


def test_weight_decay_and_init_follow_the_marks_the_layers_set():
    model = tiny_model()
    names = {id(param): name for name, param in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in group["params"]] for group in model.param_groups(0.1))
    assert sorted(no_decay) == sorted(TINY_NO_DECAY)
    assert sorted(decay + no_decay) == sorted(names.values())
    assert sorted(name for name, p in model.named_parameters() if is_residual_output(p)) == \
        sorted(TINY_RESIDUAL_OUTPUTS)
    assert [names[id(p)] for p in model.double().param_groups(0.1)[1]["params"]] == no_decay  # .to() keeps marks


def test_the_forget_gates_train_at_their_scale_of_the_given_rate_and_a_scale_without_a_rate_is_refused():
    model = tiny_model()
    groups = model.param_groups(0.1, gate_lr_scale=10.0, lr=1e-3)
    gates = {id(p) for group in groups if group["lr"] == pytest.approx(1e-2) for p in group["params"]}
    assert gates == {id(p) for p in model.parameters() if is_forget_gate(p)} and gates
    assert all(set(group) == {"params", "weight_decay", "lr"} for group in groups)  # no key that nothing reads
    with pytest.raises(ValueError, match="lr: gate_lr_scale = 10.0 scales the learning rate"):
        model.param_groups(0.1, gate_lr_scale=10.0)


@pytest.mark.parametrize("changes", [{}, dict(kda_output_gate="low_rank", kda_lower_bound=None, q_lora_rank=None,
                                             residual="prenorm", tie_embeddings=True, latent_dim=None)])
def test_every_unmarked_parameter_is_a_matrix(changes):
    """A projection (unmarked: initialised N(0, σ²) and decayed) maps activations; every vector is marked."""
    for name, param in tiny_model(**changes).named_parameters():
        assert param.dim() >= 2 or not is_decayed(param), f"{name}: a vector without the no_weight_decay mark"


def test_marks_are_checked():
    with pytest.raises(TypeError, match="param must be an nn.Parameter"):
        no_weight_decay(torch.zeros(3))
    with pytest.raises(ValueError, match="already marked residual_output"):
        no_weight_decay(residual_output(torch.nn.Parameter(torch.zeros(3, 3))))


def test_ignored_targets_do_not_count_and_tied_embeddings_share_the_table():
    model = tiny_model(tie_embeddings=True)
    assert model.lm_head is None
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    targets = tokens.clone()
    targets[:, :5] = IGNORE
    logits, loss, _ = model(tokens, targets=targets)
    expected = torch.nn.functional.cross_entropy(logits[:, 5:].flatten(0, 1), tokens[:, 5:].flatten())
    torch.testing.assert_close(loss, expected)


def test_generate_is_seeded_and_greedy_generation_is_the_argmax_continuation():
    model = tiny_model()
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(6))
    a = model.generate(prompt, 6, temperature=0.8, top_k=20, seed=3)
    assert a.shape == (2, 13) and torch.equal(a[:, :7], prompt)
    assert torch.equal(a, model.generate(prompt, 6, temperature=0.8, top_k=20, seed=3))
    greedy = model.generate(prompt, 3, temperature=0)
    sequence = prompt
    for _ in range(3):
        sequence = torch.cat([sequence, model(sequence)[0][:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, sequence)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_cache_bytes_are_the_tensors_held():
    model = tiny_model()
    cfg = model.cfg
    cache = model.new_cache(2, 50)
    model(torch.zeros(2, 50, dtype=torch.long), cache)
    assert isinstance(cache, K3Cache) and cache.length == 50
    assert cache.nbytes() == 2 * accounting.kv_cache_bytes(cfg, 50, dtype_bytes=4)


def test_bad_input_is_named():
    model = tiny_model()
    with pytest.raises(ValueError, match="tokens must be ids in"):
        model(torch.tensor([[0, 256]]))
    with pytest.raises(ValueError, match="tokens must be ids in"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match=r"tokens must be an int tensor \[B, T\]"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cache holds 2 sequences"):
        model(torch.zeros(3, 1, dtype=torch.long), model.new_cache(2, 8))
    other = tiny_model(mla_layers=())
    with pytest.raises(ValueError, match="another layer schedule"):
        model(torch.zeros(2, 1, dtype=torch.long), other.new_cache(2, 8))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="targets must have the shape of tokens"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 3, dtype=torch.long))



def test_the_exercise_form_of_a_decoder_layer_is_what_the_model_runs():
    from k3course.layers.residual import block_attnres_read
    from k3course.model import attnres_decoder_layer

    model = tiny_model(seed=7)
    with torch.no_grad():
        model.residual.queries.normal_()  # non-zero queries, so the order of reads and writes matters
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
        embedding, outputs = model.embed(tokens), []
        for index, layer in enumerate(model.layers):
            queries = model.residual.queries[2 * index:2 * index + 2]
            outputs += attnres_decoder_layer(embedding, outputs, queries, model.cfg.attnres_block_size,
                                             lambda x, layer=layer: layer.mixer(x)[0], layer.ffn,
                                             layer.mixer_norm, layer.ffn_norm)
        final = block_attnres_read(embedding, outputs, model.residual.queries[-1], model.cfg.attnres_block_size)
        logits = model.lm_head(model.final_norm(final))
        torch.testing.assert_close(logits, model(tokens)[0], rtol=1e-5, atol=1e-5)
