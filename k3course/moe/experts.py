"""Expert FFNs: the gated activations (SwiGLU, K3's SiTU-GLU), a dense GLU FFN (the shared experts) and a bank of
routed experts (:class:`~k3course.moe.dispatch.LocalDispatch` is how an MoE reaches that bank on one process)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from k3course.debug import profiler_range
from k3course.moe.dispatch import (
    expert_blocks,
    grouped_mm,
    grouped_mm_path,
)
from k3course.params import residual_output
from k3course.parts import is_replaced, part

SITU_BETA1 = 4.0  # β₁: SiTU-GLU's soft cap on the gate branch (K3)
SITU_BETA2 = 25.0  # β₂: SiTU-GLU's soft cap on the up branch (K3)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part: SiLU(gate) ⊙ up."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = SITU_BETA1,
             beta2: float = SITU_BETA2) -> torch.Tensor:
    """K3's SiTU-GLU: [β₁ tanh(gate/β₁) ⊙ σ(gate)] ⊙ [β₂ tanh(up/β₂)].

    A SwiGLU whose gate and up branches are soft-capped by tanh (|gate branch| < β₁, |up branch| < β₂), which
    bounds the activations that reach the down projection. Near 0 it equals SwiGLU. K3: β₁ = 4, β₂ = 25.
    gate, up: the same shape. One autograd node whose backward is written out (:class:`_SiTUGLU`).
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _SiTUGLU.apply(gate, up, float(beta1), float(beta2))


class _SiTUGLU(torch.autograd.Function):
    """y = a ⊙ b with the gate branch a = β₁ t₁ ⊙ s and the up branch b = β₂ t₂, where t₁ = tanh(gate/β₁),
    s = σ(gate), t₂ = tanh(up/β₂). The backward reuses a, b, s, t₁, t₂ (no tanh is recomputed):

        ∂y/∂up   = a (1 − t₂²),
        ∂y/∂gate = b [s (1 − t₁²) + a (1 − s)]     (∂a/∂gate = s (1 − t₁²) + β₁ t₁ s (1 − s)).

    Autograd through the expression above keeps a node per operation (nine) and runs about twice as many
    elementwise passes backward; torch's CPU tanh is ~9x slower than its sigmoid, so no tanh is formed twice, and
    the two are formed from expm1 (:func:`_tanh_by_expm1`)."""

    @staticmethod
    def forward(ctx, gate, up, beta1: float, beta2: float):
        s = torch.sigmoid(gate)
        t1, t2 = _tanh_by_expm1(gate, 1.0 / beta1), _tanh_by_expm1(up, 1.0 / beta2)
        gate_branch = torch.mul(t1, s).mul_(beta1)  # a
        up_branch = torch.mul(t2, beta2)  # b
        ctx.save_for_backward(s, t1, t2, gate_branch, up_branch)
        return gate_branch * up_branch

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        s, t1, t2, gate_branch, up_branch = ctx.saved_tensors
        grad_a = grad * gate_branch
        grad_up = torch.addcmul(grad_a, grad_a, t2.square(), value=-1.0)  # g a (1 − t₂²)
        slope = torch.addcmul(s, s, t1.square(), value=-1.0).add_(gate_branch)  # s (1 − t₁²) + a
        slope = torch.addcmul(slope, gate_branch, s, value=-1.0)  # − a s
        return slope.mul_(grad).mul_(up_branch), grad_up, None, None


TANH_CAP = 40.0  # 2x above which tanh(x) is 1 in float64 (1 − tanh 20 ≈ 8.5e-18): expm1 is capped there


def _tanh_by_expm1(x: torch.Tensor, scale: float) -> torch.Tensor:
    """tanh(scale·x) = e / (e + 2) with e = expm1(2·scale·x), the exponent capped at ``TANH_CAP`` (tanh = 1 there).

    Exact to about two ulp for either sign (e and e + 2 are formed without cancellation: e ∈ (−1, 0] below 0, and
    e + 2 ∈ (1, 2] there), and on a CPU about twice as fast as ``torch.tanh`` (2 × 4096 × 256 fp32, 2 threads:
    0.6 vs 1.15 ms). NaN stays NaN; ±∞ give ±1."""
    e = torch.mul(x, 2.0 * scale).clamp_(max=TANH_CAP).expm1_()
    return e.div_(e + 2.0)


def situ_glu_part(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU as every layer of the model applies it: a learner's ``situ_glu`` while :mod:`k3course.parts`
    holds one (K3's β₁ = 4, β₂ = 25 are its defaults), else :func:`situ_glu`."""
    return part("situ_glu", situ_glu)(gate, up)


ACTIVATIONS = {"swiglu": swiglu, "situ_glu": situ_glu_part}


def activation_fn(name: str):
    """The gated activation called ``name`` ('swiglu' or 'situ_glu')."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def init_weight(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> nn.Parameter:
    """W ~ N(0, 1/fan_in) of ``shape`` on ``device`` (default: torch's default device).

    On the meta device the tensor is only allocated: a shape, no values (no random numbers are drawn).
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "meta":
        return nn.Parameter(torch.empty(shape, device=device))
    draw_on = generator.device if generator is not None else device
    return nn.Parameter((torch.randn(shape, generator=generator, device=draw_on) / math.sqrt(fan_in)).to(device))


def glu_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            activation: str = "swiglu") -> torch.Tensor:
    """A dense gated FFN: act(x W_g, x W_u) W_d. x [..., d]; w_gate, w_up [d, h]; w_down [h, d] -> [..., d].
    K3's shared experts are one such FFN of n_shared_experts · expert_dim hidden units."""
    return activation_fn(activation)(x @ w_gate, x @ w_up) @ w_down


class GLUFFN(nn.Module):
    """A dense gated FFN: y = act(x W_g, x W_u) W_d. Used for shared experts (fused into one wide MLP).

    x [..., d] -> [..., d]; weights gate, up [d, h], down [h, d]; ``device="meta"`` builds shapes only.
    """

    def __init__(self, d: int, hidden: int, activation: str = "swiglu", generator: torch.Generator | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.act, self.activation = activation_fn(activation), activation
        self.gate = init_weight((d, hidden), d, generator, device)
        self.up = init_weight((d, hidden), d, generator, device)
        self.down = residual_output(init_weight((hidden, d), hidden, generator, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x @ self.gate, x @ self.up) @ self.down


class RoutedExperts(nn.Module):
    """n gated FFN experts that act on rows already grouped by expert.

    For the rows r of expert j: out[r] = act(x[r] W_g[j], x[r] W_u[j]) W_d[j].
    The gate and up weights sit side by side, gate_up [n, d_in, 2h] = [W_g | W_u], so one grouped GEMM computes
    both; down [n, h, d_in]. forward(x_sorted [M, d_in], group_offsets [n]) -> [M, d_in].
    kernels: the kernel backend of the grouped products (:func:`k3course.kernels.kernel_backend`; None:
    ``K3COURSE_KERNELS``, default "auto"), chosen here once; each forward resolves it once to a path
    (:func:`~k3course.moe.dispatch.grouped_mm_path`).
    """

    def __init__(self, n: int, d_in: int, hidden: int, activation: str = "swiglu",
                 generator: torch.Generator | None = None, kernels: str | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        from k3course.kernels import kernel_backend  # imported here: the MoE does not depend on the kernels

        self.act = activation_fn(activation)
        self.hidden, self.kernels = hidden, kernel_backend(kernels)
        self.gate_up = init_weight((n, d_in, 2 * hidden), d_in, generator, device)
        self.down = residual_output(init_weight((n, hidden, d_in), hidden, generator, device))

    @property
    def gate(self) -> torch.Tensor:
        """W_g [n, d_in, h] (a view of gate_up)."""
        return self.gate_up[..., : self.hidden]

    @property
    def up(self) -> torch.Tensor:
        """W_u [n, d_in, h] (a view of gate_up)."""
        return self.gate_up[..., self.hidden:]

    def forward(self, x_sorted: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        with profiler_range("moe.experts"):  # the expert bank's stage, for k3course bench moe
            # eager on a CPU: expert by expert; compiled, another implementation or a learner's kernel (chapter 08):
            # two grouped products
            impl = grouped_mm_path(x_sorted, self.gate_up, self.kernels)  # once: both products take it
            if impl == "loop" and not torch.compiler.is_compiling() and not is_replaced("grouped_gemm"):
                return self._expert_by_expert(x_sorted, group_offsets)
            gate_up = grouped_mm(x_sorted, self.gate_up, group_offsets, impl)  # [M, 2h]
            gate, up = gate_up.split(self.hidden, dim=-1)
            return grouped_mm(self.act(gate, up), self.down, group_offsets, impl)  # [M, d_in]

    def _expert_by_expert(self, x_sorted: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        """The loop path: each expert's whole FFN on its block before the next expert's, so the block's hidden
        activations [rows, 2h] are still in cache for the down projection, where two grouped passes write and
        re-read all M rows of [M, 2h]. The rows are split and the weights unbound once
        (:func:`~k3course.moe.dispatch.expert_blocks`) so that backward stays O(M)."""
        gate_up, down = self.gate_up.unbind(0), self.down.unbind(0)  # n views each
        blocks = []
        for expert, rows in expert_blocks(x_sorted, group_offsets):
            gate, up = (rows @ gate_up[expert]).split(self.hidden, dim=-1)  # [rows, h] each
            blocks.append(self.act(gate, up) @ down[expert])  # [rows, d_in]
        return torch.cat(blocks) if blocks else x_sorted.new_zeros(0, self.down.shape[2])
