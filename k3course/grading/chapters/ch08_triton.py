"""Chapter 08 (Triton): masked load/store, a row-wise reduction, softmax, a tiled matmul, the in-chunk cumulative
decay, one tile of the intra-chunk product, the decode step and the backward's reverse state pass. The references
are the package's Triton kernels; inputs are small fp32 tensors (the interpreter is slow)."""

from __future__ import annotations

import torch

from k3course.grading.registry import Case, Exercise, Forbidden, register
from k3course.kernels.basics import decayed_kk_tile, l2norm_rows, matmul, scale_add
from k3course.kernels.grouped_gemm import moe_grouped_gemm
from k3course.kernels.kda_chunk import (
    chunk_local_cumsum,
    intra_chunk_factors,
    intra_chunk_scores,
    output_from_states,
    state_pass,
    wy_factors,
)
from k3course.kernels.kda_chunk_backward import reverse_state_pass
from k3course.kernels.kda_decode import kda_decode_triton
from k3course.ops import kda_chunk

TORCH_MATH = Forbidden(
    frozenset({"sum", "cumsum", "exp", "exp2", "log", "sqrt", "rsqrt", "norm", "vector_norm", "normalize", "matmul",
               "rmatmul", "mm", "bmm", "einsum", "tensordot", "dot", "outer", "pow", "rpow", "square", "mul", "rmul",
               "div", "rdiv", "truediv", "rtruediv", "add", "radd", "sub", "rsub", "mean", "softmax", "rms_norm",
               "addmm", "baddbmm", "linear", "tril", "triu"}),
    "this exercise asks for a Triton kernel: compute in the kernel, and use torch only to allocate the output")
HOST_READS = frozenset({"item", "tolist", "int", "index", "float", "bool", "numpy", "nonzero", "unique", "bincount"})
TORCH_MATH_OFFSETS_ON_THE_DEVICE = Forbidden(
    TORCH_MATH.names | HOST_READS,
    "this exercise asks for a Triton kernel that reads the group offsets on the device: compute in the kernel, "
    "use torch only to allocate the output, and read no tensor back to the host (.item(), .tolist(), int(t))")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scale_add_cases() -> list[Case]:
    x, y = torch.randn(2, 300, generator=_generator(10))
    return [
        Case("n = 64, one full block", (x[:64], y[:64], 2.0)),
        Case("n = 100: the last block runs past the end", (x[:100], y[:100], -0.5)),
        Case("n = 1", (x[:1], y[:1], 3.0)),
        Case("n = 300, block 128", (x, y, 0.25), {"block": 128}),
    ]


def _matmul_cases() -> list[Case]:
    g = _generator(11)
    return [
        Case("16 x 16 times 16 x 16: one tile", (torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))),
        Case("K = 40: the loop over K", (torch.randn(16, 40, generator=g), torch.randn(40, 16, generator=g))),
        Case("ragged edges, 20 x 37 times 37 x 18",
             (torch.randn(20, 37, generator=g), torch.randn(37, 18, generator=g))),
        Case("32-wide tiles", (torch.randn(40, 64, generator=g), torch.randn(64, 33, generator=g)), {"block": 32}),
    ]


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The reference: softmax over each row of fp32 x [N, D] (torch's, which subtracts the row maximum)."""
    return torch.softmax(x, dim=-1)


def softmax_rows_online(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The reference for the blocked version: the same softmax, whatever the block."""
    return torch.softmax(x, dim=-1)


def _softmax_cases() -> list[Case]:
    return [
        Case("4 rows of 16", (torch.randn(4, 16, generator=_generator(30)),)),
        Case("3 rows of 20 (masked tail)", (torch.randn(3, 20, generator=_generator(31)),)),
        Case("large logits (subtract the row max)", (100 * torch.randn(3, 24, generator=_generator(32)),)),
        Case("one column", (torch.randn(5, 1, generator=_generator(33)),)),
        Case("rows all far below 0, 20 wide (not a power of two)",
             (-1000 + 10 * torch.randn(3, 20, generator=_generator(37)),)),
    ]


def _online_cases() -> list[Case]:
    return [
        Case("rows of 300 in blocks of 64", (torch.randn(3, 300, generator=_generator(34)),)),
        Case("the row max in the last block", (torch.cat([torch.zeros(2, 190), 50 + torch.zeros(2, 3)], 1),),
             {"block": 32}),
        Case("large logits", (80 * torch.randn(2, 150, generator=_generator(35)),), {"block": 64}),
        Case("one block is the whole row", (torch.randn(4, 40, generator=_generator(36)),), {"block": 64}),
        Case("rows all far below 0, 100 wide (not a multiple of the block)",
             (-1000 + 10 * torch.randn(3, 100, generator=_generator(38)),), {"block": 64}),
    ]


def _l2norm_cases() -> list[Case]:
    return [
        Case("8 rows of 16 (a power of two)", (torch.randn(8, 16, generator=_generator(0)),)),
        Case("5 rows of 20 (masked tail)", (torch.randn(5, 20, generator=_generator(1)),)),
        Case("one row of one", (torch.randn(1, 1, generator=_generator(2)),)),
        Case("a zero row stays zero (eps)", (torch.zeros(2, 12),)),
        Case("large values", (1e3 * torch.randn(3, 7, generator=_generator(3)),)),
        Case("tiny-norm rows (eps inside the square root)", (1e-4 * torch.randn(4, 24, generator=_generator(4)),)),
    ]


def _log_decay(T: int, H: int, K: int, seed: int, strength: float = 5.0) -> torch.Tensor:
    return -strength * torch.rand(1, T, H, K, generator=_generator(seed))


def _cumsum_cases() -> list[Case]:
    return [
        Case("T = 32, chunk 16", (_log_decay(32, 2, 16, 0),), {"chunk_size": 16}),
        Case("T = 37 (a partial last chunk), K = 20", (_log_decay(37, 1, 20, 1),), {"chunk_size": 16}),
        Case("T = 1", (_log_decay(1, 2, 16, 2),), {"chunk_size": 32}),
        Case("batch 2, chunk 32", (-torch.rand(2, 40, 2, 8, generator=_generator(3)),), {"chunk_size": 32}),
        Case("long T = 200, chunk 64, strongest decay", (_log_decay(200, 2, 8, 4),), {"chunk_size": 64}),
        Case("bfloat16 g: G is still fp32", (_log_decay(37, 1, 20, 5).bfloat16(),), {"chunk_size": 16}),
    ]


def _tile_inputs(T: int, K: int, step: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.nn.functional.normalize(torch.randn(T, K, generator=_generator(seed)), dim=-1)
    g = step * torch.rand(T, K, generator=_generator(seed + 1))
    return k, torch.cat([part.cumsum(0) for part in g.split(64)])  # in-chunk cumulative decay, chunk 64


def _tile_cases() -> list[Case]:
    weak, strong = _tile_inputs(64, 16, -0.05, 0), _tile_inputs(64, 20, -5.0, 2)
    return [
        Case("adjacent sub-chunks, weak decay", weak, {"row_start": 16, "col_start": 0}),
        Case("far sub-chunks, weak decay", weak, {"row_start": 48, "col_start": 16}),
        Case("strong decay (e^{-G} overflows fp32), K = 20", strong, {"row_start": 48, "col_start": 32}),
        Case("strong decay, adjacent to the start", strong, {"row_start": 16, "col_start": 0}),
        Case("a 32-wide tile, weak decay", weak, {"row_start": 32, "col_start": 0, "size": 32}),
        Case("a 32-wide tile at the strongest decay", strong, {"row_start": 32, "col_start": 0, "size": 32}),
    ]


def _decode_inputs(B: int, T: int, H: int, K: int, V: int, seed: int, strength: float = 1.0, unit_keys=True):
    g = _generator(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    k = torch.nn.functional.normalize(k, dim=-1) if unit_keys else 0.6 * k
    v, gate = torch.randn(B, T, H, V, generator=g), -strength * torch.rand(B, T, H, K, generator=g)
    return q, k, v, gate, torch.rand(B, T, H, generator=g), torch.randn(B, H, K, V, generator=g)


def _decode_cases() -> list[Case]:
    return [
        Case("one token, K = V = 16", _decode_inputs(1, 1, 2, 16, 16, 20)),
        Case("K = 20, V = 12 (masked)", _decode_inputs(2, 1, 1, 20, 12, 21)),
        Case("three tokens in one call", _decode_inputs(1, 3, 2, 16, 8, 22)),
        Case("the strongest decay, keys not of unit norm", _decode_inputs(1, 2, 1, 16, 16, 23, 5.0, False)),
        Case("explicit scale", _decode_inputs(1, 1, 1, 8, 8, 24), {"scale": 0.5}),
    ]


def _draw_kda_inputs(gen: torch.Generator, B: int, T: int, K: int, V: int, decay: tuple[float, float]) -> tuple:
    """q, k (unit rows), v, g (uniform in ``decay``) and β of KDA for two heads, drawn from ``gen`` in that order
    (the caller draws what else it needs from ``gen`` after them)."""
    q = torch.randn(B, T, 2, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, 2, K, generator=gen), dim=-1)
    v = torch.randn(B, T, 2, V, generator=gen)
    low, high = decay
    g = low + (high - low) * torch.rand(B, T, 2, K, generator=gen)
    return q, k, v, g, torch.rand(B, T, 2, generator=gen)


def _reverse_pass_inputs(T: int, K: int, V: int, chunk_size: int, seed: int, decay: tuple[float, float] = (-5.0, 0.0),
                         batch: int = 1, final_gradient: bool = True, scale: float | None = None,
                         grad_dtype: torch.dtype = torch.float32, strided_grad_o: bool = False) -> tuple:
    """What the reverse state pass reads, for two heads: q, k, G, W, A_qk (recomputed from seeded q, k, v, g, β by
    the package's forward kernels, as the backward does), the upstream gradients dO and dS_T (None: no gradient
    reaches the final state) and the scale (K^-1/2 unless given). g is uniform in ``decay``. The upstream gradients
    come in ``grad_dtype`` (bf16: mixed-precision training; the outputs stay fp32); ``strided_grad_o``: dO is a
    [B, T, V, H] tensor seen as [B, T, H, V] (strides (T·V·H, V·H, 1, H)), as a transposed gradient arrives."""
    gen = _generator(seed)
    q, k, v, g, beta = _draw_kda_inputs(gen, batch, T, K, V, decay)
    scale = K ** -0.5 if scale is None else scale
    gc = chunk_local_cumsum(g, chunk_size)
    akk, aqk = intra_chunk_scores(q, k, gc, beta, scale, chunk_size)
    w, _ = wy_factors(k, v, gc, beta, akk, chunk_size)
    if strided_grad_o:
        grad_o = torch.randn(batch, T, V, 2, generator=gen).transpose(2, 3)
    else:
        grad_o = torch.randn(batch, T, 2, V, generator=gen)
    grad_final = torch.randn(batch, 2, K, V, generator=gen) if final_gradient else None
    grad_o, grad_final = (None if x is None else x.to(grad_dtype) for x in (grad_o, grad_final))
    return q, k, gc, w, aqk, grad_o, grad_final, scale


def _reverse_pass_cases() -> list[Case]:
    return [
        Case("T = 32: two chunks of 16, K = V = 16, weak decay", _reverse_pass_inputs(32, 16, 16, 16, 40, (-0.2, 0.0))),
        Case("T = 37 (a partial last chunk), K = 16, V = 24", _reverse_pass_inputs(37, 16, 24, 16, 41)),
        Case("the strongest decay (g ≈ −5), chunk 64, T = 70",
             _reverse_pass_inputs(70, 16, 16, 64, 42, (-5.0, -4.99))),
        Case("no gradient reaches the final state (None), chunk 32, T = 45",
             _reverse_pass_inputs(45, 16, 16, 32, 43, final_gradient=False)),
        Case("T = 5: one partial chunk of 64", _reverse_pass_inputs(5, 16, 16, 64, 44)),
        Case("batch 2, K = 20, V = 12 (masked), chunk 16, T = 40",
             _reverse_pass_inputs(40, 20, 12, 16, 45, (-1.0, 0.0), batch=2)),
        Case("scale 0.3, not K^-1/2 (A_qk scaled alike), chunk 16, T = 35",
             _reverse_pass_inputs(35, 16, 16, 16, 46, scale=0.3)),
        Case("bf16 dO and dS_T: the outputs are still fp32, chunk 16, T = 33",
             _reverse_pass_inputs(33, 16, 16, 16, 47, grad_dtype=torch.bfloat16)),
        Case("a strided dO (a transposed [B, T, V, H] tensor), V = 24, chunk 16, T = 30",
             _reverse_pass_inputs(30, 16, 24, 16, 48, strided_grad_o=True)),
    ]


def _kda_inputs(B: int, T: int, K: int, V: int, seed: int, decay: tuple[float, float] = (-1.0, 0.0),
                dtype: torch.dtype = torch.float32) -> tuple:
    """Seeded q, k (unit rows), v, g (uniform in ``decay``), β and an initial state for two heads."""
    gen = _generator(seed)
    q, k, v, g, beta = _draw_kda_inputs(gen, B, T, K, V, decay)
    h0 = torch.randn(B, 2, K, V, generator=gen)
    return *(x.to(dtype) for x in (q, k, v, g, beta)), h0


def _intra_chunk_cases() -> list[Case]:
    def case(B, T, K, V, chunk, seed, decay=(-1.0, 0.0), scale=None, dtype=torch.float32):
        q, k, v, g, beta, _ = _kda_inputs(B, T, K, V, seed, decay, dtype)
        return q, k, v, g, beta, K ** -0.5 if scale is None else scale, chunk
    return [
        Case("T = 32: two chunks of 16, K = V = 16", case(1, 32, 16, 16, 16, 50)),
        Case("T = 37 (a partial last chunk), batch 2, K = 20, V = 12 (masked)", case(2, 37, 20, 12, 16, 51)),
        Case("the strongest decay (g ≈ −5), chunk 32, T = 40: e^{−G} overflows fp32",
             case(1, 40, 16, 16, 32, 52, (-5.0, -4.99))),
        Case("scale 0.3, not K^-1/2, T = 20", case(1, 20, 16, 16, 16, 53, scale=0.3)),
        Case("bf16 inputs: the outputs are still fp32, T = 18", case(1, 18, 16, 16, 16, 54, dtype=torch.bfloat16)),
    ]


def _state_pass_inputs(B, T, K, V, chunk, seed, decay=(-1.0, 0.0), initial=True, strided_u=False) -> tuple:
    """What the state pass reads: k, G, W, U from the package's intra-chunk step on seeded inputs, the initial
    state (or None) and the chunk size; ``strided_u``: U is a [B, T, V, H] tensor seen as [B, T, H, V]."""
    q, k, v, g, beta, h0 = _kda_inputs(B, T, K, V, seed, decay)
    gc, _, w, u = intra_chunk_factors(q, k, v, g, beta, K ** -0.5, chunk)
    if strided_u:
        u = u.transpose(2, 3).contiguous().transpose(2, 3)
    return k, gc, w, u, h0 if initial else None, chunk


def _state_pass_cases() -> list[Case]:
    return [
        Case("T = 32: two chunks of 16, no initial state (None: zero)", _state_pass_inputs(1, 32, 16, 16, 16, 60,
                                                                                              initial=False)),
        Case("T = 37 (a partial last chunk), K = 20, V = 24 (two value blocks), an initial state",
             _state_pass_inputs(1, 37, 20, 24, 16, 61)),
        Case("the strongest decay (g ≈ −5), chunk 32, T = 45",
             _state_pass_inputs(1, 45, 16, 16, 32, 62, (-5.0, -4.99))),
        Case("batch 2, V = 12 (masked), T = 20", _state_pass_inputs(2, 20, 16, 12, 16, 63)),
        Case("a strided U (a transposed [B, T, V, H] tensor), T = 30", _state_pass_inputs(1, 30, 16, 16, 16, 64,
                                                                                           strided_u=True)),
    ]


def _output_inputs(B, T, K, V, chunk, seed, decay=(-1.0, 0.0), scale=None, dtype=torch.float32) -> tuple:
    """What the output kernel reads: q, G, the states entering each chunk, Ṽ and A_qk (from the package's steps on
    seeded inputs), and the scale (A_qk scaled alike); q in ``dtype``."""
    q, k, v, g, beta, h0 = _kda_inputs(B, T, K, V, seed, decay)
    scale = K ** -0.5 if scale is None else scale
    gc, aqk, w, u = intra_chunk_factors(q, k, v, g, beta, scale, chunk)
    states, v_new, _ = state_pass(k, gc, w, u, h0, chunk)
    return q.to(dtype), gc, states, v_new, aqk, scale


def _output_cases() -> list[Case]:
    return [
        Case("T = 32: two chunks of 16, K = V = 16", _output_inputs(1, 32, 16, 16, 16, 70)),
        Case("T = 37 (a partial last chunk), batch 2, K = 20, V = 24", _output_inputs(2, 37, 20, 24, 16, 71)),
        Case("scale 0.3, not K^-1/2 (A_qk scaled alike)", _output_inputs(1, 20, 16, 16, 16, 72, scale=0.3)),
        Case("the strongest decay (g ≈ −5), chunk 32, T = 40", _output_inputs(1, 40, 16, 16, 32, 73, (-5.0, -4.99))),
        Case("bf16 q: the output is still fp32, T = 18", _output_inputs(1, 18, 16, 16, 16, 74, dtype=torch.bfloat16)),
    ]


def _grouped_inputs(counts: list[int], K: int, N: int, seed: int, offsets_dtype=torch.int32,
                    strided_x: bool = False, transposed_weights: bool = False) -> tuple:
    """x_sorted [M, K] (M = Σ counts), expert_weights [E, K, N] and the END offsets [E] of ``counts`` rows per
    expert; ``strided_x``: x's rows are 8 columns further apart than K (a slice of a wider tensor);
    ``transposed_weights``: the bank is an [E, N, K] tensor seen as [E, K, N] (as dX = dY Wᵀ reads it)."""
    gen = _generator(seed)
    M, E = sum(counts), len(counts)
    x = torch.randn(M, K + 8, generator=gen)[:, 4:4 + K] if strided_x else torch.randn(M, K, generator=gen)
    w = torch.randn(E, N, K, generator=gen).transpose(1, 2) if transposed_weights else torch.randn(E, K, N,
                                                                                                 generator=gen)
    return x, w, torch.tensor(counts).cumsum(0).to(offsets_dtype)


def grouped_gemm_reference(x_sorted: torch.Tensor, expert_weights: torch.Tensor,
                           group_offsets: torch.Tensor) -> torch.Tensor:
    """The reference: expert e's rows [ends[e−1], ends[e]) times its weight, one torch matmul per expert — what
    the package's grouped GEMM op (``moe_grouped_gemm``, refused in an answer) computes in one launch; written
    here, where the grader's torch maths is not the learner's (tests/test_grouped_gemm_exercise.py: the two
    agree)."""
    ends = group_offsets.tolist()
    return torch.cat([x_sorted[start:end] @ expert_weights[e] for e, (start, end) in enumerate(zip([0, *ends], ends))])


def _grouped_gemm_cases() -> list[Case]:
    return [
        Case("6 experts, two empty, 63 rows, K = 24, N = 40", _grouped_inputs([5, 0, 40, 1, 0, 17], 24, 40, 90)),
        Case("the first and the last experts empty, int64 offsets",
             _grouped_inputs([0, 9, 12, 0], 16, 16, 91, torch.int64)),
        Case("one expert holds 70 rows: more than one tile of rows", _grouped_inputs([70, 3], 16, 20, 92)),
        Case("K = 37, N = 19: partial blocks along both", _grouped_inputs([4, 13, 2], 37, 19, 93)),
        Case("strided x: rows 8 columns further apart than K", _grouped_inputs([6, 0, 11], 20, 24, 94,
                                                                               strided_x=True)),
        Case("a transposed weight bank (strides (N·K, 1, K))", _grouped_inputs([7, 9, 0, 5], 16, 24, 95,
                                                                               transposed_weights=True)),
        Case("one row, eight experts, seven of them empty", _grouped_inputs([0, 0, 0, 1, 0, 0, 0, 0], 16, 16, 96)),
    ]


def kda_chunk_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                        *, lower_bound=None):
    """The reference for the three kernels composed: the package's chunk op (chapter 07's torch path)."""
    return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, lower_bound=lower_bound)


def _composed_case(name: str, T: int, K: int, V: int, chunk: int, seed: int, decay=(-1.0, 0.0), **kwargs) -> Case:
    q, k, v, g, beta, h0 = _kda_inputs(1, T, K, V, seed, decay)
    return Case(name, (q, k, v, g, beta), {"initial_state": h0, "output_final_state": True, "chunk_size": chunk,
                                           **kwargs})


def _composed_cases() -> list[Case]:
    return [
        _composed_case("T = 37 (odd), K = 20, V = 12, an initial state, chunk 16", 37, 20, 12, 16, 80),
        _composed_case("K3's bounded gate: g down to −6 clamped at −5, scale 0.3, chunk 32, T = 45", 45, 16, 24, 32,
                       81, (-6.0, 0.0), lower_bound=-5.0, scale=0.3),
    ]


register(Exercise("08.kda_chunk", kda_chunk_reference, _composed_cases, tolerance={"float32": (1e-5, 2e-5)},
                  package=(kda_chunk,), isolate=True, guard_bands=True))
register(Exercise("08.kda_intra_chunk", intra_chunk_factors, _intra_chunk_cases, forbidden=TORCH_MATH, isolate=True,
                  guard_bands=True))
register(Exercise("08.kda_state_pass", state_pass, _state_pass_cases, forbidden=TORCH_MATH, isolate=True,
                  guard_bands=True))
register(Exercise("08.kda_chunk_output", output_from_states, _output_cases, forbidden=TORCH_MATH, isolate=True,
                  guard_bands=True))
register(Exercise("08.reverse_state_pass", reverse_state_pass, _reverse_pass_cases, forbidden=TORCH_MATH,
                  isolate=True, guard_bands=True))
register(Exercise("08.grouped_gemm", grouped_gemm_reference, _grouped_gemm_cases,
                  forbidden=TORCH_MATH_OFFSETS_ON_THE_DEVICE, package=(moe_grouped_gemm,), isolate=True,
                  guard_bands=True))
register(Exercise("08.kda_decode", kda_decode_triton, _decode_cases, mutable=("state",), forbidden=TORCH_MATH,
                  isolate=True, guard_bands=True))
for exercise_id, reference, cases in (("08.scale_add", scale_add, _scale_add_cases),
                                      ("08.l2norm_rows", l2norm_rows, _l2norm_cases),
                                      ("08.softmax_rows", softmax_rows, _softmax_cases),
                                      ("08.softmax_online", softmax_rows_online, _online_cases),
                                      ("08.matmul", matmul, _matmul_cases),
                                      ("08.chunk_cumsum", chunk_local_cumsum, _cumsum_cases),
                                      ("08.kk_tile", decayed_kk_tile, _tile_cases)):
    register(Exercise(exercise_id, reference, cases, forbidden=TORCH_MATH, isolate=True, guard_bands=True))
