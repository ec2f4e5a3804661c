"""Chapter 13: expert parallelism. Each function is a number a lesson quotes (see :mod:`k3course.lessons.quoted`)."""

from __future__ import annotations

from k3course.config import K3Config
from k3course.distributed import cost
from k3course.lessons.quoted.markers import quoted
from k3course.lessons.quoted.size import k3_config


@quoted
def ranks_holding(n: int, ranks: int, size: str) -> int:
    """How many of ``ranks`` hold the larger ("big") or smaller ("small") block of ``n`` experts."""
    big = n % ranks
    return big if size == "big" else ranks - big


@quoted
def block_size(n: int, ranks: int, size: str) -> int:
    """Experts per rank in the larger ("big") or smaller ("small") block."""
    return n // ranks + (1 if size == "big" else 0)


@quoted
def latent_row_kib(dtype_bytes: int = 2) -> float:
    """One K3 token's latent row (ℓ numbers), KiB."""
    return k3_config().latent_dim * dtype_bytes / 2**10


@quoted
def ep_ranks_reached(n: int = 896, k: int = 16, ranks: int = 64) -> float:
    """Other ranks a token's k experts land on, on average (uniform routing)."""
    return cost.expected_ranks_reached(n, k, ranks)


@quoted
def ep_remote_slots(k: int = 16, ranks: int = 64) -> float:
    """Token-slots that leave their rank, on average: k·(P − 1)/P."""
    return cost.remote_slots(k, ranks)


@quoted
def ep_network_rows(cluster: str = "SuperNode (64)", part: str = "network") -> int:
    """Of a GPU's P − 1 other ranks in ``cluster``, how many sit outside its NVLink domain ("network"), or all."""
    ranks, per_domain = cost.CLUSTERS[cluster]
    return ranks - per_domain if part == "network" else ranks - 1


@quoted
def ep_cluster_slowdown(width: str = "latent", dedup: bool = False, dispatch: str = "bf16") -> float:
    """K3's all-to-all time on the 64-GPU SuperNode over the 8-GPU node (4096 tokens per GPU, uniform routing)."""
    cfg = k3_config()
    columns = cfg.latent_dim if width == "latent" else cfg.d_model
    seconds = {name: cost.all_to_all_seconds(4096, columns, cfg.top_k, cfg.n_routed_experts, ranks, per_domain,
                                             dedup, dispatch)
               for name, (ranks, per_domain) in cost.CLUSTERS.items()}
    return seconds["SuperNode (64)"] / seconds["DGX B300 (8)"]


@quoted
def ep_dedup_saving(part: str = "dispatch", ranks: int = 64) -> float:
    """What deduplication saves of K3's latent bf16 dispatch ("dispatch") or dispatch + combine ("all")."""
    cfg = k3_config()
    args = (cfg.latent_dim, cfg.top_k, cfg.n_routed_experts, ranks)
    measure = cost.dispatch_bytes_per_token if part == "dispatch" else cost.bytes_per_token
    return 1 - measure(*args, dedup=True) / measure(*args, dedup=False)


@quoted
def ep_replicated_crossover(name: str = "kimi-k3") -> int:
    """The smallest EP degree at which a rank's block of routed experts weighs less than the replicated weights."""
    cfg = K3Config.preset(name)
    return next(p for p in range(1, cfg.n_routed_experts + 1)
                if cost.weight_bytes_per_rank(cfg, p)["experts"] < cost.weight_bytes_per_rank(cfg, p)["replicated"])


@quoted
def ep_fp8_dispatch_share() -> float:
    """fp8 dispatch bytes (with scales) over bf16's."""
    return cost.FP8_VALUE_BYTES / 2


LAYOUTS = ("replicated", "fsdp_ep", "fsdp")  # replicated DP × EP over 64, FSDP2 × EP over 64, FSDP2 alone


def _mesh(gpus: int, layout: str) -> tuple[int, int]:
    """(dp_shard, ep) of ``layout`` on ``gpus`` GPUs: EP over a 64-GPU SuperNode, or none (FSDP2 alone)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (gpus, 1) if layout == "fsdp" else (gpus // 64, 64)


@quoted
def k3_rank_training_gib(gpus: int, layout: str, part: str = "total") -> float:
    """GiB one K3 rank holds to train (bf16 weights and gradients, fp32 AdamW moments) on ``gpus`` GPUs in
    ``layout`` (:data:`LAYOUTS`); ``part``: "weights", "gradients", "optimizer" or "total"."""
    dp_shard, ep = _mesh(gpus, layout)
    held = (cost.replicated_training_bytes_per_rank(k3_config(), ep) if layout == "replicated"
            else cost.training_bytes_per_rank(k3_config(), dp_shard, ep))
    return (sum(held.values()) if part == "total" else held[part]) / 2**30


@quoted
def k3_step_collective_gib(gpus: int, layout: str, kind: str, tokens: int = 4096) -> float:
    """GiB one K3 rank receives in one step's ``kind`` collective ("all-gather", "reduce-scatter", "all-to-all")
    on ``gpus`` GPUs in ``layout`` ("fsdp_ep" or "fsdp"), ``tokens`` tokens a rank."""
    return cost.step_collective_bytes(k3_config(), *_mesh(gpus, layout), tokens)[kind] / 2**30
