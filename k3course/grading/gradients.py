"""The gradients a backward case compares: of L = Σ_i ⟨w_i, output_i⟩ with respect to named inputs.

The weights w_i are seeded (one per floating output, by position), so the learner's function and the reference
are differentiated through the same scalar. For the learner this runs on the fresh stack of its call: like
:mod:`k3course.grading.fresh_stack`, this module imports nothing that leads to the exercise or its reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class NoGradient(Exception):
    """The function's output carries no gradient at all (computed under no_grad, detached, through NumPy)."""


def _floating_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors in an output (nested tuples, lists and dicts), in order."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, tuple | list):
        return [t for item in output for t in _floating_tensors(item)]
    if isinstance(output, dict):
        return [t for key in output for t in _floating_tensors(output[key])]
    return []


def _weight(output: torch.Tensor, position: int) -> torch.Tensor:
    """The seeded weight w_i of output i: standard normal entries, in the output's dtype."""
    generator = torch.Generator().manual_seed(7919 + position)
    return torch.randn(output.shape, generator=generator).to(output.dtype)


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def leaves(named: dict[str, Any], wrt: tuple[str, ...] | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(replacements, leaves): for the inputs named in ``wrt`` (None: every input) that are floating tensors, or
    lists of them, fresh copies that require a gradient; ``leaves`` names each tensor ('outputs[2]' in a list)."""
    replacements, found = {}, {}
    for name in named if wrt is None else wrt:
        value = named.get(name)
        if _differentiable(value):
            replacements[name] = found[name] = value.detach().clone().requires_grad_()
        elif isinstance(value, list | tuple) and value and all(_differentiable(item) for item in value):
            copies = [item.detach().clone().requires_grad_() for item in value]
            replacements[name] = type(value)(copies)
            found.update({f"{name}[{i}]": leaf for i, leaf in enumerate(copies)})
    return replacements, found


def weighted_sum(output: Any, positions: tuple[int, ...] | None = None) -> torch.Tensor:
    """L = Σ_i ⟨w_i, output_i⟩ over the output's floating tensors that carry a gradient (those at ``positions``
    among them, when given)."""
    terms = [(t * _weight(t, i)).sum() for i, t in enumerate(_floating_tensors(output))
             if t.requires_grad and (positions is None or i in positions)]
    if not terms:
        raise NoGradient("your output carries no gradient: computed under torch.no_grad(), detached, or through "
                         "NumPy / .item()? Training differentiates this function: keep it in torch")
    return sum(terms)


def gradients(fn: Callable[..., Any], args: tuple, kwargs: dict, wrt: dict[str, torch.Tensor],
              positions: tuple[int, ...] | None = None) -> dict[str, torch.Tensor | None]:
    """{name: dL/d(input)} for ``fn(*args, **kwargs)``, whose inputs ``wrt`` are leaves, L over the floating
    outputs at ``positions`` (None: all); None for an input L does not depend on through autograd."""
    loss = weighted_sum(fn(*args, **kwargs), positions)
    found = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return dict(zip(wrt, found))


def finite_differences(call: Callable[[dict[str, torch.Tensor]], Any], wrt: dict[str, torch.Tensor],
                       positions: tuple[int, ...] | None = None, step: float = 1e-6) -> dict[str, torch.Tensor]:
    """{name: dL/d(input)} by float64 central differences of L, for a reference without autograd: ``call(inputs)``
    runs it with the tensor inputs replaced by ``inputs`` (float64 copies of ``wrt``, nudged one entry at a time).
    Returned in the inputs' own dtypes. Small tensor inputs only: two calls per entry."""
    inputs = {name: leaf.detach().double() for name, leaf in wrt.items()}

    def loss() -> float:
        with torch.no_grad():
            output = call(inputs)
        return sum(float((t.double() * _weight(t, i).double()).sum())
                   for i, t in enumerate(_floating_tensors(output)) if positions is None or i in positions)

    found = {}
    for name, x in inputs.items():
        flat, grad = x.view(-1), torch.zeros(x.numel(), dtype=torch.float64)
        for i in range(flat.numel()):
            kept = float(flat[i])
            flat[i] = kept + step
            above = loss()
            flat[i] = kept - step
            below = loss()
            flat[i] = kept
            grad[i] = (above - below) / (2 * step)
        found[name] = grad.view(x.shape).to(wrt[name].dtype)
    return found
