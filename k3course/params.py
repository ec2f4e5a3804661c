"""What a parameter is, marked where its layer creates it (a leaf of the package).

:class:`k3course.model.K3Model` initialises and groups its parameters by these marks, never by their names
(as fla marks ``A_log`` and ``dt_bias`` with ``_no_weight_decay``):

    no_weight_decay(p)    p keeps the values its layer gives it and gets no weight decay: norm gains, biases,
                          gate rates (A_log, dt_bias), convolution taps, AttnRes queries
    residual_output(p)    p is the last map of a sub-layer, which writes into the residual stream: initialised
                          N(0, (σ/√(2L))²) instead of N(0, σ²), and decayed
    forget_gate(p)        p computes a forget gate (the decay's projection, bias and rate of KDA, GDN and decayed
                          linear attention): with ``gate_lr_scale`` ≠ 1 it trains at that multiple of the learning
                          rate (:func:`param_groups`); combines with either mark above

Every unmarked parameter is a projection (a matrix mapping activations): initialised N(0, σ²), and decayed.
A mark is an attribute of the ``nn.Parameter`` object: ``module.to(...)``, ``load_state_dict`` and pickling keep
it; ``copy.deepcopy`` does not (torch's ``Parameter.__deepcopy__`` copies the data only), nor does replacing the
parameter by a new one (loading onto a meta-built model): :func:`carry_marks` copies them over.
"""

from __future__ import annotations

from torch import nn

from k3course.guards import is_number


def no_weight_decay(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as keeping its layer's initial values, without weight decay; returns it."""
    _check_unmarked(param, "_residual_output")
    param._no_weight_decay = True
    return param


def residual_output(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as the last map of a sub-layer (the scaled initialisation); returns it."""
    _check_unmarked(param, "_no_weight_decay")
    param._residual_output = True
    return param


def forget_gate(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as a forget gate's parameter (its own learning-rate scale); returns it."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"param must be an nn.Parameter, got {type(param).__name__}")
    param._forget_gate = True
    return param


def is_forget_gate(param: nn.Parameter) -> bool:
    """True when ``param`` is marked :func:`forget_gate`."""
    return getattr(param, "_forget_gate", False)


def param_groups(params, weight_decay: float, gate_lr_scale: float = 1.0, lr: float | None = None) -> list[dict]:
    """AdamW groups by the marks: weight decay on the projections, none on the :func:`no_weight_decay`
    parameters. Given ``lr``, each group carries its rate "lr"; with ``gate_lr_scale`` ≠ 1 the :func:`forget_gate`
    parameters form groups of their own at "lr" = lr × gate_lr_scale (which needs ``lr``: a scale without the
    rate it scales is refused). ``gate_lr_scale`` = 1: two groups, the gates among them. Empty groups are left
    out. (TrainConfig.gate_lr_scale sets it for a run; chapter 12's recall experiments, for theirs.)"""
    params = list(params)
    if not (is_number(gate_lr_scale, int | float) and gate_lr_scale > 0):
        raise ValueError(f"gate_lr_scale must be a number > 0, got {gate_lr_scale!r}")
    if gate_lr_scale != 1 and lr is None:
        raise ValueError(f"lr: gate_lr_scale = {gate_lr_scale} scales the learning rate; give lr, the rate it scales")
    scales = (1.0,) if gate_lr_scale == 1 else (1.0, float(gate_lr_scale))
    groups = []
    for scale in scales:
        chosen = [p for p in params if gate_lr_scale == 1 or is_forget_gate(p) == (scale != 1.0)]
        for decayed in (True, False):
            members = [p for p in chosen if is_decayed(p) == decayed]
            if members or scale == 1.0:
                groups.append({"params": members, "weight_decay": weight_decay if decayed else 0.0,
                               **({} if lr is None else {"lr": lr * scale})})
    return groups


def is_decayed(param: nn.Parameter) -> bool:
    """True unless ``param`` is marked :func:`no_weight_decay`."""
    return not getattr(param, "_no_weight_decay", False)


def is_residual_output(param: nn.Parameter) -> bool:
    """True when ``param`` is marked :func:`residual_output`."""
    return getattr(param, "_residual_output", False)


def carry_marks(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """Give ``new`` the marks of ``old``, the parameter it replaces; returns ``new``."""
    if getattr(old, "_no_weight_decay", False):
        no_weight_decay(new)
    if getattr(old, "_residual_output", False):
        residual_output(new)
    if is_forget_gate(old):
        forget_gate(new)
    return new


def _check_unmarked(param, other_mark: str) -> None:
    """An nn.Parameter without the other, contradicting mark (a residual output is decayed)."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"param must be an nn.Parameter, got {type(param).__name__}")
    if getattr(param, other_mark, False):
        raise ValueError(f"param is already marked {other_mark.strip('_')}: a residual output is decayed")
