"""A toy decoder and a synthetic language for comparing residual schemes in a few seconds on a CPU.

The language is a random order-2 Markov chain over a small vocabulary: each pair of previous tokens picks the
next token from its own sparse distribution. A model must look back two tokens (attention) and map the pair
to a distribution (MLP); the best possible loss is the chain's own conditional entropy, which
:func:`markov_batch` reports for every batch, so curves can be read against that floor.

:class:`ToyDecoder` is a stack of decoder layers, each a causal-attention sub-layer and an MLP sub-layer,
PreNorm, wired through any residual scheme of :mod:`k3course.layers.residual`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3course.layers.residual import make_residual
from k3course.lessons.fit import fit


def markov_table(vocab: int, seed: int, concentration: float = 0.2) -> torch.Tensor:
    """Next-token probabilities of an order-2 chain: [vocab, vocab, vocab], rows drawn from Dirichlet(concentration).

    A small concentration makes each row sparse (a few likely successors), so the chain is learnable.
    """
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    generator = torch.Generator().manual_seed(seed)
    gamma = torch._standard_gamma(torch.full((vocab, vocab, vocab), concentration, dtype=torch.float64),
                                  generator=generator)
    return (gamma / gamma.sum(-1, keepdim=True)).float()


def markov_batch(table: torch.Tensor, batch: int, length: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Sample ``batch`` sequences of ``length + 1`` tokens from the chain.

    Returns (inputs [batch, length], targets [batch, length], the true-model loss on these targets: the
    floor no model can beat on average).
    """
    vocab = table.shape[0]
    tokens = torch.randint(vocab, (batch, 2), generator=generator)
    true_nll = []
    for _ in range(length - 1):
        probs = table[tokens[:, -2], tokens[:, -1]]                          # [batch, vocab]
        nxt = torch.multinomial(probs, 1, generator=generator)             # [batch, 1]
        true_nll.append(-probs.gather(1, nxt).log())
        tokens = torch.cat([tokens, nxt], dim=1)
    floor = torch.cat(true_nll).mean().item()                               # first target has no full context
    return tokens[:, :-1], tokens[:, 1:], floor


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention: o = W_O softmax(q kᵀ / sqrt(d_h) + causal mask) v. x: [B, T, D]."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # [B, H, T, D/H]
        return self.out(o.transpose(1, 2).reshape(batch, length, width))


class ToyDecoder(nn.Module):
    """Token + position embedding → n_layers × [attention, MLP] (PreNorm) through a residual scheme → logits.

    residual: 'prenorm', 'full_attnres' or 'block_attnres' (block_size in sub-layers: 2 per decoder layer), as
    :func:`~k3course.layers.residual.make_residual` names them.
    forward(tokens [B, T]) -> (logits [B, T, vocab], the residual stream; its ``weights`` hold the depth
    attention of every read when ``record``).
    """

    def __init__(self, vocab: int, d_model: int, n_layers: int, residual: str, block_size: int | None = None,
                 n_heads: int = 2, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.sublayers = nn.ModuleList()
        for _ in range(n_layers):
            self.sublayers.append(CausalSelfAttention(d_model, n_heads))
            self.sublayers.append(nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                nn.Linear(4 * d_model, d_model)))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in self.sublayers)
        self.residual = make_residual(residual, len(self.sublayers), d_model, block_size)
        self.final_norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.position.shape[0]:
            raise ValueError(f"tokens: length {tokens.shape[1]} exceeds max_len={self.position.shape[0]}")
        return self.embed(tokens) + self.position[: tokens.shape[1]]

    def forward(self, tokens: torch.Tensor, record: bool = False):
        stream = self.residual.begin(self.embedding(tokens), record=record)
        for sublayer, norm in zip(self.sublayers, self.norms):
            stream.write(sublayer(norm(stream.read())))
        return self.head(self.final_norm(stream.final())), stream


def sublayer_input_rms(model: ToyDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """RMS of the hidden state each sub-layer reads (and the final read), averaged over tokens: [n_sublayers + 1].

    For PreNorm this is the residual stream h_l; for AttnRes it is the depth-attention mix.
    """
    reads = []
    with torch.no_grad():
        stream = model.residual.begin(model.embedding(tokens))
        for sublayer, norm in zip(model.sublayers, model.norms):
            reads.append(stream.read())
            stream.write(sublayer(norm(reads[-1])))
        reads.append(stream.final())
    return torch.stack([h.square().mean(-1).sqrt().mean() for h in reads])


def train_toy(residual: str, seed: int, steps: int = 200, vocab: int = 16, d_model: int = 32, n_layers: int = 4,
              block_size: int | None = None, batch: int = 16, length: int = 32, lr: float = 3e-3,
              data_seed: int = 0) -> dict:
    """Train a :class:`ToyDecoder` on the Markov language; the same data for every scheme and seed.

    ``seed`` sets the model's initialisation; ``data_seed`` the language and the batches. Returns
    {'model', 'losses' [steps], 'eval_loss', 'floor'} (eval on one fixed held-out batch).
    """
    table = markov_table(vocab, data_seed)
    torch.manual_seed(seed)
    model = ToyDecoder(vocab, d_model, n_layers, residual, block_size)
    data = torch.Generator().manual_seed(data_seed + 1)

    def loss_at(step: int) -> torch.Tensor:  # the batches are drawn in order from ``data``
        inputs, targets, _ = markov_batch(table, batch, length, data)
        return F.cross_entropy(model(inputs)[0].flatten(0, 1), targets.flatten())

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = fit(optimizer, steps, loss_at, schedule_kind="constant")
    inputs, targets, floor = markov_batch(table, 64, length, torch.Generator().manual_seed(data_seed + 2))
    with torch.no_grad():
        eval_loss = F.cross_entropy(model(inputs)[0][:, 1:].flatten(0, 1), targets[:, 1:].flatten()).item()
    return {"model": model, "losses": torch.tensor(losses), "eval_loss": eval_loss, "floor": floor}
