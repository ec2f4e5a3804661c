"""Lesson 14 §12, what a token costs: K3 served on B300s (:func:`k3course.accounting.serving_cost`) against the
explainer's list price."""

from __future__ import annotations

from k3course import accounting
from k3course.config import K3Config
from k3course.lessons.quoted.markers import quoted

# The seeds' deployment of K3 and its list price: weights on "nearly six GPUs in Nvidia DGX B300" at lower
# precision, a "super node of 64 GPUs", "$3 per million input tokens and $15 per million output tokens".
K3_LIST_USD_PER_MILLION = {"input": 3.0, "output": 15.0}
B300_USD_PER_GPU_HOUR = 5.0  # the course's assumption: a rented B300, late 2026 (†)


RELEASE = accounting.RELEASED_PRECISION  # MXFP4 routed experts, the rest bf16: K3 as released


@quoted
def k3_serving(field: str, precision: str = RELEASE, gpus: int | None = 64, batch: int | None = None,
               context: int = 32768, placement: str = "expert-parallel") -> float:
    """A field of :func:`k3course.accounting.serving_cost` for K3 on B300s at the assumed price (50 % utilisation),
    lesson 13's expert-parallel layout unless ``placement`` says otherwise; "read_per_gpu_gib": the bytes one GPU
    reads per decode step, in GiB."""
    cost = accounting.serving_cost(K3Config.preset("kimi-k3"), "B300", precision, B300_USD_PER_GPU_HOUR, gpus,
                                   context, batch, placement=placement)
    return cost.read_per_gpu / accounting.GIB if field == "read_per_gpu_gib" else getattr(cost, field)


@quoted
def k3_list_over_roofline(kind: str, precision: str = RELEASE, gpus: int | None = 64, batch: int | None = None,
                          placement: str = "expert-parallel") -> float:
    """The seeds' list price over the roofline cost of ``kind`` ("input" or "output") tokens."""
    field = f"usd_per_million_{kind}"
    return K3_LIST_USD_PER_MILLION[kind] / k3_serving(field, precision, gpus, batch, placement=placement)


@quoted
def k3_output_over_input(batch: int | None = None, precision: str = RELEASE, gpus: int | None = 64) -> float:
    """The roofline price of an output token over an input token's, K3 on B300s (the list prices say 5)."""
    return (k3_serving("usd_per_million_output", precision, gpus, batch)
            / k3_serving("usd_per_million_input", precision, gpus, batch))


@quoted
def k3_replicated_gib(precision: str = RELEASE) -> float:
    """GiB of K3's router, shared experts and latent projections: what lesson 13's layout puts on every GPU."""
    cfg = K3Config.preset("kimi-k3")
    components = accounting.param_count(cfg).components
    replicated = sum(components[name][0] for name in accounting.MOE_REPLICATED)
    return replicated * accounting.WEIGHT_PRECISIONS[precision].other_bytes / accounting.GIB
