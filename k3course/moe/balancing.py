"""Load balancing: the Switch aux loss and router z-loss, DeepSeek-V3's sign rule, K3's quantile balancing.

The sign rule and quantile balancing move a per-expert bias b that steers top-k selection only
(:func:`k3course.moe.routing.topk_route`); they run under ``no_grad`` after each step, and the new bias is
used from the next step on. See lesson 03 for the LP-dual derivation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3course.guards import is_number
from k3course.moe.routing import _check_bias, _check_k, _check_scores

SIGN_RULE_STEP = 1e-3  # γ: the sign rule's bias step (DeepSeek-V3's update speed)
AUX_LOSS_WEIGHT = 1e-2  # α: the Switch loss's weight in the training loss (Switch Transformer's)
HISTOGRAM_BINS = 256  # bins of the margin histograms that quantile balancing pools over ranks


def expert_load(expert_idx: torch.Tensor, n: int) -> torch.Tensor:
    """Token-slots per expert: load_j = #{(t, slot): expert_idx[t, slot] = j}. [m, k] -> [n] int64.

    A scatter-add into n counters (``torch.bincount`` reads the largest index back to the host on a GPU).
    """
    if expert_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_idx must be an integer tensor, got dtype {expert_idx.dtype}")
    flat = expert_idx.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def switch_aux_loss(probs: torch.Tensor, expert_idx: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Switch load-balancing loss α · n · Σ_j f_j P_j (= α when perfectly balanced).

    f_j = load_j / (m k): the fraction of token-slots sent to expert j (no gradient: counts);
    P_j = mean_t probs[t, j]: the mean router probability (carries the gradient).
    probs [m, n] with rows summing to 1 (for a sigmoid router pass s / Σ_j s); expert_idx [m, k] -> scalar.
    """
    _check_scores(probs, "probs")
    m, n = probs.shape
    fraction = expert_load(expert_idx, n).to(probs.dtype) / expert_idx.numel()
    return alpha * n * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean_t (logsumexp_j logit_tj)², keeps router logits small. [m, n] -> scalar."""
    _check_scores(logits, "logits")
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(wide, dim=-1).square().mean().to(logits.dtype)


def sign_rule_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3 loss-free balancing, one step: b_j ← b_j − γ · sign(load_j − mean load).

    bias [n], load [n] (counts) -> new bias [n]. SignSGD on the dual of the balanced-assignment LP.
    """
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        raise ValueError(f"bias must be a 1-D tensor [n experts], got {getattr(bias, 'shape', type(bias).__name__)}")
    if tuple(load.shape) != tuple(bias.shape):
        raise ValueError(f"load must have the shape of bias {tuple(bias.shape)}, got {tuple(load.shape)}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    load = load.to(torch.float64)
    return bias - gamma * torch.sign(load - load.mean()).to(bias.dtype)


def token_cutoffs(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """α_t = the (k+1)-th largest biased score s_t + b of each token (−∞ when k = n). [m, n], [n] -> [m]."""
    biased = scores + bias
    if k == scores.shape[1]:  # every expert is chosen: no cutoff to beat
        return torch.full_like(biased[:, 0], float("-inf"))
    return torch.topk(biased, k + 1, dim=1).values[:, k]


def _check_balance_inputs(scores: torch.Tensor, bias: torch.Tensor, k: int) -> None:
    _check_scores(scores)
    n = scores.shape[1]
    _check_k(k, n)
    _check_bias(bias, n)


def quantile_balance_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """K3's quantile balancing: a coordinate step on the dual of the balanced-assignment LP.

    α_t = (k+1)-th largest of s_t + b;  q = ⌊m k / n⌋;
    b̂_j = −(the (q+1)-th largest over tokens t of the margin s_tj − α_t);  return b̂ − mean(b̂).
    With b̂, expert j beats token t's cutoff for exactly its q best-margin tokens: each expert is filled to
    its target load in one step (up to how the cutoffs move). Order statistics are values, so ties in the
    scores give the same bias whatever order they are visited in. With k = n every expert takes every token
    whatever the bias: the step returns b − mean(b).
    scores [m, n] (detached), bias [n] -> new bias [n], computed in fp64, returned in bias.dtype.
    """
    _check_balance_inputs(scores, bias, k)
    m, n = scores.shape
    if k == n:
        return bias - bias.mean()
    target = (m * k) // n
    scores64, bias64 = scores.detach().double(), bias.detach().double()
    margins = scores64 - token_cutoffs(scores64, bias64, k)[:, None]  # [m, n]
    # [n]: the (q+1)-th largest = (m-q)-th smallest; one contiguous row per expert (faster than along dim 0)
    kth = torch.kthvalue(margins.mT.contiguous(), m - target, dim=1).values
    new_bias = -kth
    return (new_bias - new_bias.mean()).to(bias.dtype)


def quantile_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """The margins s_tj − α_t in fp64 (α_t from :func:`token_cutoffs`), after checking the inputs.

    scores [m, n], bias [n], k < n -> [m, n] float64 on the scores' device.
    """
    _check_balance_inputs(scores, bias, k)
    scores64 = scores.detach().double()
    return scores64 - token_cutoffs(scores64, bias.detach().double(), k)[:, None]


def margin_histogram(margins: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Per-expert histogram of the margins of one holder's tokens.

    margins [m, n] float64, edges [bins + 1] increasing (shared by all holders) -> counts [n, bins] int64, on
    the margins' device. Margins on the last edge go in the last bin. Summing these over ranks (an all-reduce)
    gives the histogram of all tokens.
    """
    bins = edges.numel() - 1
    which = torch.bucketize(margins, edges.double(), right=True) - 1  # bin of each margin
    which = which.clamp(0, bins - 1)
    n = margins.shape[1]
    offsets = bins * torch.arange(n, device=margins.device)  # expert j's bins start at j·bins
    flat = which.T + offsets[:, None]  # [n, m]
    return torch.bincount(flat.reshape(-1), minlength=n * bins).reshape(n, bins)


def margin_histogram_for(device: torch.device | str, kernels: str):
    """The margin histogram for the kernel backend ``kernels`` (:func:`k3course.kernels.kernel_backend`) on
    ``device``: one Triton launch (:func:`k3course.kernels.quantile_histogram.margin_histogram_triton`) where
    :func:`k3course.kernels.use_triton` says so, else :func:`margin_histogram`; both (margins, edges) -> counts."""
    from k3course.kernels import use_triton  # imported here: the balancing rules do not depend on the kernels

    if use_triton(device, kernels):
        from k3course.kernels.quantile_histogram import margin_histogram_triton

        return margin_histogram_triton
    return margin_histogram


def bias_from_histogram(counts: torch.Tensor, edges: torch.Tensor, target: int) -> torch.Tensor:
    """Read b̂_j = −(the (q+1)-th largest margin of expert j) off a histogram, then mean-centre.

    Counting down from the top bin, the (q+1)-th largest margin lies in the first bin where the count from
    the top reaches q + 1; the estimate is that bin's midpoint (within half a bin of the exact value).
    counts [n, bins], edges [bins + 1], target q -> bias [n] float64.
    """
    from_top = counts.flip(1).cumsum(1)  # [n, bins]: counts in bins ≥ this one, top bin first
    bins = counts.shape[1]
    if (from_top[:, -1] <= target).any():
        raise ValueError(f"target must be < the tokens counted per expert ({int(from_top[:, -1].min())}), "
                         f"got {target}")
    top_bin = bins - 1 - (from_top > target).to(torch.int64).argmax(1)  # [n]
    midpoints = (edges[:-1] + edges[1:]).double() / 2
    new_bias = -midpoints[top_bin]
    return new_bias - new_bias.mean()


Reduction = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, "sum" | "max") -> the same over all holders


def on_this_process(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """The reduction when one process holds every token: the tensor itself."""
    return tensor


def _pooled_edges(margins: torch.Tensor, bins: int, reduce: Reduction) -> torch.Tensor:
    """edges [bins + 1] float64 from the min to the max margin of all holders (one max-reduction of
    [−min, max]); a holder without tokens contributes (+∞, −∞)."""
    if margins.numel():
        extremes = torch.stack([-margins.min(), margins.max()])
    else:
        extremes = torch.tensor([float("-inf"), float("-inf")], dtype=torch.float64, device=margins.device)
    low, high = reduce(extremes, "max").tolist()
    return torch.linspace(-low, high, bins + 1, dtype=torch.float64, device=margins.device)


def histogram_quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int = HISTOGRAM_BINS,
                            reduce: Reduction = on_this_process, tokens: int | None = None,
                            kernels: str = "auto") -> torch.Tensor:
    """Quantile balancing read off margin histograms pooled by ``reduce``: the one routine for one process,
    for ranks (an all-reduce, :func:`k3course.distributed.balancing.all_reduce_over`) and for the simulation.

    Per call the margins s_tj − α_t of this holder's tokens are formed once; edges span [min, max] over all
    holders (one max-reduction), the per-expert counts are summed (one sum-reduction), and
    b̂_j = −(the (q+1)-th largest margin of expert j) is read off the pooled histogram with q = ⌊M k / n⌋.
    Integer counts sum exactly and the edges are the same floats on every holder, so every holder gets the same
    bias, within one bin width of :func:`quantile_balance_bias` on all M tokens. k = n: b − mean(b), as there.
    scores [m_r, n] (this holder's, m_r may be 0), bias [n]; tokens: M when already pooled (else one
    sum-reduction of m_r); kernels: the backend of the histogram (:func:`margin_histogram_for`) -> new bias [n]
    in bias.dtype, on the scores' device.
    """
    if not is_number(bins) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    if k == scores.shape[-1]:  # every expert takes every token: no margin to read
        return quantile_balance_bias(scores, bias, k)
    margins = quantile_margins(scores, bias, k)  # [m_r, n]
    if tokens is None:
        tokens = int(reduce(torch.tensor(scores.shape[0], device=scores.device), "sum"))
    if tokens == 0:
        raise ValueError("scores must hold at least one token over all holders, got none")
    edges = _pooled_edges(margins, bins, reduce)
    counts = reduce(margin_histogram_for(margins.device, kernels)(margins, edges), "sum")  # [n, bins]
    return bias_from_histogram(counts, edges, tokens * k // scores.shape[1]).to(bias.dtype)


def quantile_balance_bias_from_histograms(score_shards: list[torch.Tensor], bias: torch.Tensor, k: int,
                                          bins: int = HISTOGRAM_BINS) -> torch.Tensor:
    """Quantile balancing when the m tokens are spread over ranks (one [m_r, n] score shard per rank),
    simulated on one process.

    A margin depends on its own token only, so the histogram of the concatenated shards over edges spanning
    all of them is the sum of the shards' histograms: :func:`histogram_quantile_bias` on the concatenation,
    bit for bit what P ranks all-reducing their histograms get. -> new bias [n] in bias.dtype.
    """
    if not score_shards:
        raise ValueError("score_shards must hold at least one [m_r, n] tensor")
    return histogram_quantile_bias(torch.cat(score_shards), bias, k, bins)
