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


@quoted
def k3_serving(field: str, precision: str = "int4", gpus: int | None = 64, batch: int | None = None,
               context: int = 32768) -> float:
    """A field of :func:`k3course.accounting.serving_cost` for K3 on B300s at the assumed price (50 % utilisation)."""
    cost = accounting.serving_cost(K3Config.preset("kimi-k3"), "B300", precision, B300_USD_PER_GPU_HOUR, gpus,
                                   context, batch)
    return getattr(cost, field)


@quoted
def k3_list_over_roofline(kind: str, precision: str = "int4", gpus: int | None = 64, batch: int | None = None) -> float:
    """The seeds' list price over the roofline cost of ``kind`` ("input" or "output") tokens."""
    field = f"usd_per_million_{kind}"
    return K3_LIST_USD_PER_MILLION[kind] / k3_serving(field, precision, gpus, batch)


@quoted
def k3_output_over_input(batch: int | None = None, precision: str = "int4", gpus: int | None = 64) -> float:
    """The roofline price of an output token over an input token's, K3 on B300s (the list prices say 5)."""
    return (k3_serving("usd_per_million_output", precision, gpus, batch)
            / k3_serving("usd_per_million_input", precision, gpus, batch))
