"""Chapter 11 (the assembled K3): the layer schedule, one decoder layer in Block AttnRes order, the decode
step's cache write, the parameter count of the real module tree, and generation: one sampled token (temperature,
top-k) and the loop that feeds each token back through the cache."""

from __future__ import annotations

import torch

from k3course.accounting import meta_param_count
from k3course.config import K3Config, layer_schedule
from k3course.grading.registry import Case, Exercise, register
from k3course.layers.mla import write_rows
from k3course.model import K3Model, attnres_decoder_layer, sample_next


def _schedule_cases() -> list[Case]:
    settings = {"tiny (4 layers, 3:1)": (4, 3, 1), "K3 (93 layers, 3:1)": (93, 3, 1),
                "last layer forced to MLA (10 layers, 3:1)": (10, 3, 2), "1:1": (7, 1, 0),
                "all MLA (ratio 0)": (5, 0, 1), "7:1 with 3 dense layers": (17, 7, 3), "one layer": (1, 3, 1),
                "every layer dense": (6, 2, 6)}
    return [Case(name, args) for name, args in settings.items()]


def _sublayer(weight: torch.Tensor):
    """A stand-in sub-layer x -> tanh(x W): the exercise is about the wiring, not the mixer."""
    def apply(x):
        return torch.tanh(x @ weight)
    return apply


def _rms_norm(weight: torch.Tensor):
    def apply(x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)
    return apply


def _layer_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1100)
    cases = []
    for name, (n_outputs, block_size, dtype) in {"first layer": (0, 4, torch.float32),
                                                 "mid-block": (2, 4, torch.float32),
                                                 "a block completes at the mixer": (3, 4, torch.float32),
                                                 "block size 1 (Full AttnRes)": (4, 1, torch.float32),
                                                 "block size 2, deep": (6, 2, torch.float32),
                                                 "float64": (2, 4, torch.float64)}.items():
        d = 8
        randn = lambda *shape, dtype=dtype: torch.randn(*shape, generator=g).to(dtype)
        embedding, outputs = randn(2, 3, d), [randn(2, 3, d) for _ in range(n_outputs)]
        queries = randn(2, d)
        mixer, ffn = _sublayer(randn(d, d) / d**0.5), _sublayer(randn(d, d) / d**0.5)
        norms = _rms_norm(1 + 0.1 * randn(d)), _rms_norm(1 + 0.1 * randn(d))
        cases.append(Case(name, (embedding, outputs, queries, block_size, mixer, ffn, *norms)))
    return cases


def _cache_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1101)
    cases = []
    for name, (capacity, length, new, dtype) in {"one token, room left": (8, 3, 1, torch.float32),
                                                 "prefill into an empty cache": (16, 0, 5, torch.float32),
                                                 "exactly full": (6, 5, 1, torch.float32),
                                                 "one past capacity: doubles": (4, 4, 1, torch.float32),
                                                 "a long chunk: grows to fit": (4, 3, 9, torch.float32),
                                                 "room left, but too little: grows": (8, 6, 3, torch.float32),
                                                 "bf16 cache": (8, 2, 3, torch.bfloat16),
                                                 "bf16 cache that grows": (4, 3, 2, torch.bfloat16)}.items():
        buffer = torch.zeros(2, capacity, 6, dtype=dtype)
        buffer[:, :length] = torch.randn(2, length, 6, generator=g).to(dtype)
        cases.append(Case(name, (buffer, length, torch.randn(2, new, 6, generator=g).to(dtype))))
    return cases


def total_and_active(cfg: K3Config) -> tuple[int, int]:
    """(total, active) parameters of K3Model(cfg), counted on the meta device (bias buffers excluded)."""
    counts = meta_param_count(cfg)
    return counts["total"], counts["active"]


def _count_cases() -> list[Case]:
    tiny = K3Config.preset("tiny")
    return [Case("tiny", (tiny,)), Case("small", (K3Config.preset("small"),)),
            Case("tied embeddings", (tiny.replace(tie_embeddings=True),)),
            Case("no latent, no shared experts", (tiny.replace(latent_dim=None, n_shared_experts=0),)),
            Case("PreNorm (no AttnRes queries)", (tiny.replace(residual="prenorm"),)),
            Case("no MoE layer (every FFN dense)", (tiny.replace(first_k_dense=tiny.n_layers),)),
            Case("explicit mla_layers (not the ratio's plan)",
                 (K3Config.preset("small").replace(mla_layers=(0, 1, 2)),)),
            Case("Kimi K3", (K3Config.preset("kimi-k3"),))]


def _sample_cases() -> list[Case]:
    """Logits [B, V] with B ≠ V (a top-k over the wrong axis changes the answer) and a seeded generator."""
    g = torch.Generator().manual_seed(1102)
    greedy = 3 * torch.randn(5, 40, generator=g)
    cases = [Case("greedy (temperature 0)", (greedy, 0.0, None, None)),
             Case("temperature 0 with a generator: greedy, the generator left as it was",
                  (greedy, 0.0, 4, torch.Generator().manual_seed(99)))]
    for name, (rows, vocab, temperature, top_k, dtype) in {
            "temperature 1, no top-k": (64, 40, 1.0, None, torch.float32),
            "temperature 0.7, top-k 5": (64, 40, 0.7, 5, torch.float32),
            "hot (temperature 3), top-k 8": (48, 30, 3.0, 8, torch.float32),
            "top-k 1 is greedy": (16, 30, 1.5, 1, torch.float32),
            "top-k = vocabulary": (32, 12, 0.5, 12, torch.float32),
            "bf16 logits (sampled in fp32)": (64, 40, 0.9, 6, torch.bfloat16),
            "bf16 logits, 2048 rows (softmax in bf16 rounds the probabilities)": (2048, 40, 1.0, None,
                                                                                  torch.bfloat16)}.items():
        logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
        cases.append(Case(name, (logits, temperature, top_k, torch.Generator().manual_seed(len(cases)))))
    tied = torch.randint(0, 4, (256, 40), generator=g).float()  # many logits equal the k-th largest
    cases.append(Case("ties at the k-th logit: every tied token is kept",
                      (tied, 1.0, 5, torch.Generator().manual_seed(5))))
    return cases


class MeteredModel:
    """A K3Model behind a meter: it counts the positions it runs on and refuses to run on more than ``budget``
    (prompt + new tokens: each position once, which a cached loop never exceeds), notes whether any call ran in
    training mode, and refuses ``generate`` (the exercise is to write it). Compared by its weights."""

    def __init__(self, model: K3Model, budget: int):
        self.model, self.budget, self.positions, self.ran_in_training = model, budget, 0, False

    def __call__(self, tokens, cache=None, targets=None):
        self.positions += tokens.shape[1]
        self.ran_in_training |= self.model.training
        if self.positions > self.budget:
            raise RuntimeError(f"the model ran on {self.positions} positions per sequence, more than prompt + new "
                               f"tokens = {self.budget}: is the prompt run again each step instead of the cache used?")
        return self.model(tokens, cache, targets)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> MeteredModel:
        self.model.train(mode)
        return self

    def eval(self) -> MeteredModel:
        return self.train(False)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None):
        return self.model.new_cache(batch, max_len, device, dtype)

    def generate(self, *args, **kwargs):
        raise RuntimeError("model.generate is the package's answer to this exercise: write the loop yourself "
                           "(model(x, cache) and your sample_next)")

    def state_dict(self) -> dict:
        return self.model.state_dict()


def generate(model, tokens: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
             seed: int | None) -> torch.Tensor:
    """The package's :meth:`K3Model.generate` (in eval mode, the caller's mode restored after; prefill once, then
    one cached step per new token; the tokens drawn by sample_next with
    ``torch.Generator(tokens.device).manual_seed(seed)``, with the global RNG when seed is None)
    -> [B, T + max_new_tokens]."""
    return (model.model if isinstance(model, MeteredModel) else model).generate(tokens, max_new_tokens, temperature,
                                                                                 top_k, seed)


def generated_and_what_it_left(answer, model: MeteredModel, tokens: torch.Tensor, max_new_tokens: int,
                               temperature: float, top_k: int | None, seed: int | None) -> dict:
    """``answer(model, tokens, ...)`` with the global RNG seeded (so seed None draws the same numbers for both),
    then restored -> {"tokens", whether the global RNG moved, whether the model ran in training mode, its mode
    after the call (the caller's, restored), whether the tokens are inference tensors (autograd refuses them)}."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1105)
        before = torch.random.get_rng_state()
        out = answer(model, tokens, max_new_tokens, temperature, top_k, seed)
        rng_moved = not torch.equal(before, torch.random.get_rng_state())
    return {"tokens": out, "the global RNG changed state": rng_moved,
            "the model ran in training mode": model.ran_in_training,
            "the model is in training mode after the call": model.training,
            "tokens made under torch.inference_mode()": isinstance(out, torch.Tensor) and out.is_inference()}


def _grading_model() -> K3Model:
    """A seeded 2-layer K3 (one KDA, one MLA layer; one MoE FFN) in eval mode, its head scaled so the logits
    spread over several nats: far from ties, sampled tokens do not hinge on rounding."""
    torch.manual_seed(1103)
    cfg = K3Config.preset("tiny").replace(n_layers=2, d_model=64, kda_per_mla=1)
    model = K3Model.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    return model


def _generate_cases() -> list[Case]:
    model, g = _grading_model(), torch.Generator().manual_seed(1104)
    training = _grading_model().train()
    cases = []
    for name, (batch, prompt, new, temperature, top_k, seed, handed) in {
            "greedy": (2, 5, 6, 0.0, None, None, model),
            "sampled, temperature 0.8, top-k 20": (2, 5, 8, 0.8, 20, 3, model),
            "sampled, temperature 1, no top-k": (3, 4, 8, 1.0, None, 0, model),
            "one new token": (2, 6, 1, 1.0, 5, 7, model),
            "no new tokens": (1, 4, 0, 1.0, None, 1, model),
            "a prompt longer than a KDA chunk": (1, 70, 4, 0.7, 10, 2, model),
            "a one-token prompt": (2, 1, 5, 0.9, 12, 4, model),
            "temperature 0 with a seed: greedy": (2, 3, 4, 0.0, None, 5, model),
            "seed None: drawn from the global RNG, as documented": (2, 4, 5, 1.0, None, None, model),
            "a model handed in training mode: generated in eval mode, handed back in training mode":
                (2, 5, 4, 0.8, 10, 6, training)}.items():
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=g)
        cases.append(Case(name, (MeteredModel(handed, prompt + new), tokens, new, temperature, top_k, seed)))
    return cases


register(Exercise("11.layer_schedule", layer_schedule, _schedule_cases))
register(Exercise("11.decoder_layer", attnres_decoder_layer, _layer_cases))
register(Exercise("11.cache_write", write_rows, _cache_cases, mutable=("buffer",)))
register(Exercise("11.param_count", total_and_active, _count_cases, package=(meta_param_count,)))
register(Exercise("11.sample_next", sample_next, _sample_cases, mutable=("generator",)))
register(Exercise("11.generate", generate, _generate_cases, harness=generated_and_what_it_left,
                  package=(K3Model.generate,)))
