"""Residual schemes for a decoder stack: standard PreNorm, Full and Block Attention Residuals (lesson 10).

A stack of L sub-layers (a decoder layer is two: attention, then MLP) uses any scheme the same way::

    stream = scheme.begin(embedding)          # embedding: [B, T, D]
    for sublayer, norm in zip(sublayers, norms):
        stream.write(sublayer(norm(stream.read())))
    h = stream.final()                        # what the output norm reads

prenorm       read() = v_0 + v_1 + … + v_{l-1}: each earlier output has weight 1, so the stream grows O(L)
              and a late layer's contribution is diluted.
FullAttnRes   read() = Σ_{i<l} softmax_i(w_lᵀ RMSNorm(v_i)) v_i over the embedding and every earlier output.
BlockAttnRes  outputs are grouped into blocks of ``block_size`` sub-layers, each represented by its sum;
              read() attends over [v_0, completed block sums, the current block's partial sum].
              block_size 1 is FullAttnRes; one block covering the stack mixes just v_0 and Σ v_i.

Pseudo-queries w (one per sub-layer plus one final aggregation: K3 has two per decoder layer and one before
the output norm) start at zero, so every read starts as a uniform average over its sources. Keys are an RMSNorm of
the sources, no 1/√d. With ``key_weight`` each read also has a learned key-norm weight g (K3's release: the
``*_res_norm`` tensors), starting at ones and not decayed, like every norm weight: the logit w·(g ⊙ RMSNorm(v)) equals
(w ⊙ g)·RMSNorm(v), so it changes the parameters and their training, not what a read can compute. Without it the
keys are parameter-free (the course's presets as trained).
With ``record=True`` a stream keeps the depth-attention weights of each read, for plotting.
The attention schemes take the model's kernel backend (``kernels``, :func:`k3course.kernels.kernel_backend`): where
:func:`k3course.kernels.use_triton` says so, every read runs the one-pass Triton kernel of
:mod:`k3course.kernels.depth_attention` (forward and backward), else :func:`depth_attention`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from k3course.ops.norm import NORM_EPS
from k3course.params import no_weight_decay
from k3course.parts import part


def depth_attention(query: torch.Tensor, sources: torch.Tensor,
                    eps: float = NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """h = Σ_i softmax_i(queryᵀ RMSNorm(v_i)) v_i, per token; the softmax runs over depth (the sources).

    query: [D]; sources: [N, B, T, D] -> (h [B, T, D], weights [N, B, T]). Computed in fp32 or wider, with the
    closed-form backward of :class:`_DepthAttention`.
    """
    wide = torch.promote_types(sources.dtype, torch.float32)
    h, weights = _DepthAttention.apply(query.to(wide), sources.to(wide), eps)
    return h.to(sources.dtype), weights


def depth_attention_for(device: torch.device | str, kernels: str):
    """The depth read for the kernel backend ``kernels`` on ``device``: the Triton kernels' op
    (:func:`k3course.kernels.depth_attention.depth_attention_triton`) where :func:`k3course.kernels.use_triton`
    says so and the call is not being compiled (torch.compile fuses the torch op itself), else
    :func:`depth_attention`. Both take (query [D], sources [N, B, T, D], eps) -> (h, weights)."""
    from k3course.kernels import use_triton  # imported here: the residual schemes do not depend on the kernels

    if use_triton(device, kernels) and not torch.compiler.is_compiling():
        from k3course.kernels.depth_attention import depth_attention_triton

        return depth_attention_triton
    return depth_attention


class _DepthAttention(torch.autograd.Function):
    """Depth attention without materialising the keys RMSNorm(v_i) ``[N, B, T, D]``.

    The logit of source i at a token is s_i = r_i (v_i · w), r_i = (mean_d v_i² + ε)^{-1/2}: one dot product and
    one norm per token. Backward, with α = softmax(s) and upstream ∂L/∂h:
        ∂L/∂s_i = α_i (∂L/∂α_i − Σ_j α_j ∂L/∂α_j),  ∂L/∂α_i = v_i · ∂L/∂h,
        ∂L/∂v_i = α_i ∂L/∂h + c_i (w − s_i r_i v_i / D)  with c_i = r_i ∂L/∂s_i  (∂s_i/∂v_i = r_i w − s_i r_i² v_i / D),
        ∂L/∂w = Σ_i Σ_tokens c_i v_i.
    Three passes over the sources forward and four backward, where autograd through the RMSNorm keys takes twice
    as many. The backward is written once: a second derivative raises (it would silently miss r, s and α's
    dependence on the sources)."""

    @staticmethod
    def forward(ctx, query, sources, eps):
        D = sources.shape[-1]
        inv_rms = torch.rsqrt(torch.linalg.vector_norm(sources, dim=-1).square_().div_(D).add_(eps))  # r, [N, B, T]
        logits = (sources @ query).mul_(inv_rms)  # s, [N, B, T]
        weights = torch.softmax(logits, dim=0)  # α
        h = (weights.unsqueeze(-1) * sources).sum(0)  # [B, T, D]
        ctx.save_for_backward(query, sources, inv_rms, logits, weights)
        ctx.mark_non_differentiable(weights)
        return h, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h, _):
        query, sources, inv_rms, logits, weights = ctx.saved_tensors
        grad_weights = torch.linalg.vecdot(sources, grad_h)  # ∂L/∂α, [N, B, T]
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(0))
        c = grad_logits * inv_rms
        grad_query = c.reshape(1, -1) @ sources.reshape(-1, sources.shape[-1])  # [1, D]
        grad_sources = weights.unsqueeze(-1) * grad_h  # α_i ∂L/∂h
        grad_sources.addcmul_(c.unsqueeze(-1), query)
        grad_sources.addcmul_((c * logits * inv_rms).div_(-sources.shape[-1]).unsqueeze(-1), sources)
        return grad_query.view(-1), grad_sources, None


def block_sources(embedding: torch.Tensor, outputs: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """What the next read of Block AttnRes attends over, built from scratch (the streams keep it incrementally).

    embedding [B, T, D]; outputs: the l sub-layer outputs so far, each [B, T, D]; blocks hold ``block_size``
    consecutive outputs. Returns [N, B, T, D] = [v_0, sum of block 1, sum of block 2, …], where the last
    entry is the current block's partial sum when l is not a multiple of block_size (an empty block adds
    nothing: N = 1 + ceil(l / block_size)).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (sub-layers per block), got {block_size!r}")
    sums = [torch.stack(outputs[i:i + block_size]).sum(0) for i in range(0, len(outputs), block_size)]
    return torch.stack([embedding, *sums])


def block_attnres_read(embedding: torch.Tensor, outputs: list[torch.Tensor], query: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """One Block AttnRes aggregation: h = depth_attention(query, block_sources(embedding, outputs, block_size)).

    embedding [B, T, D], outputs l × [B, T, D], query [D] -> h [B, T, D].
    """
    return depth_attention(query, block_sources(embedding, outputs, block_size))[0]


def _check_sizes(n_sublayers: int, d_model: int) -> None:
    for name, value in (("n_sublayers", n_sublayers), ("d_model", d_model)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_embedding(embedding: torch.Tensor, d_model: int) -> None:
    if not isinstance(embedding, torch.Tensor) or embedding.dim() != 3 or embedding.shape[-1] != d_model:
        shape = tuple(embedding.shape) if isinstance(embedding, torch.Tensor) else type(embedding).__name__
        raise ValueError(f"embedding must be [B, T, d_model={d_model}], got {shape}")


class _Stream:
    """One forward pass through a stack: counts reads and writes so every sub-layer uses its own query."""

    def __init__(self, n_sublayers: int, record: bool):
        self.n_sublayers, self.record = n_sublayers, record
        self.written = 0
        self.weights: list[torch.Tensor] = []   # per read: [N_sources, B, T] (attention schemes, when recording)

    def _next_read(self, final: bool) -> int:
        if final and self.written != self.n_sublayers:
            raise RuntimeError(f"final() after {self.written} of {self.n_sublayers} sub-layers: write them all first")
        if not final and self.written >= self.n_sublayers:
            raise RuntimeError(f"read(): all {self.n_sublayers} sub-layers are written; call final()")
        return self.written

    def _check_output(self, output: torch.Tensor, like: torch.Tensor) -> None:
        if not isinstance(output, torch.Tensor) or output.shape != like.shape:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"output must have the embedding's shape {tuple(like.shape)}, got {shape}")
        if self.written >= self.n_sublayers:
            raise RuntimeError(f"write(): the stack has only {self.n_sublayers} sub-layers")


class StandardResidual(nn.Module):
    """PreNorm residual: h_l = h_{l-1} + f_l(norm(h_{l-1})), i.e. read() = v_0 + Σ_{i<l} v_i. No parameters."""

    def __init__(self, n_sublayers: int, d_model: int):
        super().__init__()
        _check_sizes(n_sublayers, d_model)
        self.n_sublayers, self.d_model = n_sublayers, d_model

    def begin(self, embedding: torch.Tensor, record: bool = False) -> _StandardStream:
        _check_embedding(embedding, self.d_model)
        return _StandardStream(embedding, self.n_sublayers, record)


class _StandardStream(_Stream):
    def __init__(self, embedding: torch.Tensor, n_sublayers: int, record: bool):
        super().__init__(n_sublayers, record)
        self.hidden = embedding

    def read(self) -> torch.Tensor:
        self._next_read(final=False)
        return self.hidden

    def write(self, output: torch.Tensor) -> None:
        self._check_output(output, self.hidden)
        self.hidden = self.hidden + output
        self.written += 1

    def final(self) -> torch.Tensor:
        self._next_read(final=True)
        return self.hidden


def _add_queries(scheme: nn.Module, key_weight: bool, kernels: str | None) -> None:
    """The depth-attention parameters of ``scheme``: ``queries`` [n_sublayers + 1, d_model] at zero and, with
    ``key_weight``, ``key_norms`` of the same shape at one (both without weight decay); else ``key_norms`` None.
    Also its kernel backend ``kernels`` (:func:`k3course.kernels.kernel_backend`), chosen here once."""
    from k3course.kernels import kernel_backend  # imported here: the residual schemes do not depend on the kernels

    scheme.kernels = kernel_backend(kernels)
    shape = (scheme.n_sublayers + 1, scheme.d_model)
    scheme.queries = no_weight_decay(nn.Parameter(torch.zeros(shape)))
    scheme.key_norms = no_weight_decay(nn.Parameter(torch.ones(shape))) if key_weight else None


class FullAttnRes(nn.Module):
    """Full Attention Residuals: each read attends over the embedding and every earlier sub-layer output.

    queries: [n_sublayers + 1, d_model], zero at init (row n_sublayers is the final aggregation); key_norms (with
    ``key_weight``): the key-norm weight of each read, same shape, one at init; kernels: the kernel backend of
    the reads (see the module docstring).
    """

    def __init__(self, n_sublayers: int, d_model: int, eps: float = NORM_EPS, key_weight: bool = False,
                 kernels: str | None = None):
        super().__init__()
        _check_sizes(n_sublayers, d_model)
        self.n_sublayers, self.d_model, self.eps = n_sublayers, d_model, eps
        _add_queries(self, key_weight, kernels)

    def begin(self, embedding: torch.Tensor, record: bool = False) -> _FullStream:
        _check_embedding(embedding, self.d_model)
        return _FullStream(self, embedding, record)


class _DepthStream(_Stream):
    """A stream whose reads attend over depth: h = Σ_i softmax_i(w_lᵀ RMSNorm(v_i)) v_i over ``sources()``."""

    def __init__(self, scheme: FullAttnRes | BlockAttnRes, record: bool):
        super().__init__(scheme.n_sublayers, record)
        self.scheme = scheme

    def sources(self) -> torch.Tensor:
        raise NotImplementedError

    def _attend(self, index: int) -> torch.Tensor:
        sources = self.sources()
        # a learner's, while k3course.parts holds one
        attend = part("depth_attention", depth_attention_for(sources.device, self.scheme.kernels))
        query = self.scheme.queries[index]
        if self.scheme.key_norms is not None:  # w·(g ⊙ RMSNorm(v)) = (w ⊙ g)·RMSNorm(v)
            query = query * self.scheme.key_norms[index]
        h, weights = attend(query, sources, self.scheme.eps)
        if self.record:
            self.weights.append(weights.detach())
        return h

    def read(self) -> torch.Tensor:
        return self._attend(self._next_read(final=False))

    def final(self) -> torch.Tensor:
        return self._attend(self._next_read(final=True))


class _FullStream(_DepthStream):
    def __init__(self, scheme: FullAttnRes, embedding: torch.Tensor, record: bool):
        super().__init__(scheme, record)
        self.values = [embedding]                                      # v_0, v_1, ...

    def sources(self) -> torch.Tensor:
        """[N, B, T, D]: the embedding and every sub-layer output so far."""
        return torch.stack(self.values)

    def write(self, output: torch.Tensor) -> None:
        self._check_output(output, self.values[0])
        self.values.append(output)
        self.written += 1


class BlockAttnRes(nn.Module):
    """Block Attention Residuals: reads attend over [v_0, completed block sums, current partial sum].

    block_size counts sub-layers (K3: 12 decoder layers = 24 sub-layers). The partial sum joins the sources
    only once its block has an output, so block_size 1 equals :class:`FullAttnRes`.
    queries: [n_sublayers + 1, d_model], zero at init; key_norms (with ``key_weight``) and kernels as in
    :class:`FullAttnRes`.
    """

    def __init__(self, n_sublayers: int, d_model: int, block_size: int, eps: float = NORM_EPS,
                 key_weight: bool = False, kernels: str | None = None):
        super().__init__()
        _check_sizes(n_sublayers, d_model)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (sub-layers per block), got {block_size!r}")
        self.n_sublayers, self.d_model, self.block_size, self.eps = n_sublayers, d_model, block_size, eps
        _add_queries(self, key_weight, kernels)

    def begin(self, embedding: torch.Tensor, record: bool = False) -> _BlockStream:
        _check_embedding(embedding, self.d_model)
        return _BlockStream(self, embedding, record)


class _BlockStream(_DepthStream):
    def __init__(self, scheme: BlockAttnRes, embedding: torch.Tensor, record: bool):
        super().__init__(scheme, record)
        self.embedding = embedding
        self.completed: list[torch.Tensor] = []                        # sums of finished blocks
        self.partial: torch.Tensor | None = None                       # sum of the current block so far

    def sources(self) -> torch.Tensor:
        """[N, B, T, D]: the embedding, completed block sums, and the partial sum if the block has begun."""
        partial = [] if self.partial is None else [self.partial]
        return torch.stack([self.embedding, *self.completed, *partial])

    def write(self, output: torch.Tensor) -> None:
        self._check_output(output, self.embedding)
        self.partial = output if self.partial is None else self.partial + output
        self.written += 1
        if self.written % self.scheme.block_size == 0:                 # the block is complete
            self.completed.append(self.partial)
            self.partial = None


RESIDUAL_KINDS = ("prenorm", "full_attnres", "block_attnres")


def make_residual(kind: str, n_sublayers: int, d_model: int, block_size: int | None = None, eps: float = NORM_EPS,
                  key_weight: bool = False, kernels: str | None = None) -> nn.Module:
    """The residual scheme module of ``kind``, named as ``K3Config.residual`` names it: 'prenorm' (standard
    PreNorm), 'block_attnres' (needs block_size), or 'full_attnres' (the config's 'block_attnres' with block size
    1, written as its own scheme). The attention schemes' key RMSNorm takes ``eps`` and, with ``key_weight``, a
    learned weight per read; their reads run on the kernel backend ``kernels``."""
    if kind == "prenorm":
        return StandardResidual(n_sublayers, d_model)
    if kind == "full_attnres":
        return FullAttnRes(n_sublayers, d_model, eps, key_weight, kernels)
    if kind == "block_attnres":
        if block_size is None:
            raise ValueError("block_size is needed for kind='block_attnres'")
        return BlockAttnRes(n_sublayers, d_model, block_size, eps, key_weight, kernels)
    raise ValueError(f"kind must be one of {RESIDUAL_KINDS}, got {kind!r}")


def depth_weight_matrix(weights: list[torch.Tensor], n_sublayers: int, block_size: int | None = None) -> torch.Tensor:
    """Average recorded weights over batch and tokens into a [reads, sources] matrix for a heatmap.

    Column 0 is the embedding; for Full AttnRes column i is v_i, for Block AttnRes column j is block j (its
    completed sum or partial sum). Sources a read could not see are NaN.
    """
    n_columns = 1 + (n_sublayers if block_size is None else -(-n_sublayers // block_size))
    matrix = torch.full((len(weights), n_columns), float("nan"))
    for row, w in enumerate(weights):
        matrix[row, : w.shape[0]] = w.float().mean(dim=(1, 2)).cpu()
    return matrix


def visible_sources(n_sublayers: int, block_size: int | None = None) -> torch.Tensor:
    """Which source each read attends through, for every earlier output: an int map for plotting.

    Returns [n_sublayers + 1 reads, n_sublayers + 1 outputs v_0 … v_L] where entry (l, i) is the index of the
    source of read l that contains v_i (0 is the embedding), or -1 when read l cannot see v_i yet (i ≥ l + 1,
    counting v_0). block_size None is Full AttnRes (every output its own source).
    """
    _check_sizes(n_sublayers, 1)
    size = 1 if block_size is None else block_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    reads = torch.arange(n_sublayers + 1)[:, None]                      # read l sees v_0 … v_l
    outputs = torch.arange(n_sublayers + 1)[None, :]
    source = torch.where(outputs == 0, 0, (outputs - 1) // size + 1)    # v_i (i ≥ 1) lies in block (i-1)//size
    return torch.where(outputs <= reads, source, -1)
