"""The GPU path compiles, even without a GPU: every kernel is compiled ahead of time for an H100/H200 (sm_90)
through Triton's full pipeline down to a cubin, at the shapes the benchmarks use, and fits in shared memory.

The compile runs in a fresh interpreter that reports a GPU to ``k3course.kernels`` (so the kernels are
``@triton.jit`` functions rather than interpreted ones); nothing is launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPILE_SCRIPT = r'''
import json, sys
import torch
torch.cuda.is_available = lambda: True  # compile (not interpret); nothing here launches a kernel
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3course.kernels import (TRITON_MODE, basics, flash_mla, grouped_gemm, kda_chunk, kda_chunk_backward, kda_decode,
                              worked_attention)
from k3course.kernels import depth_attention, quantile_histogram

assert TRITON_MODE == "native", TRITON_MODE
TARGET = GPUTarget("cuda", 90, 32)


def pointer_type(name, dtype, kernel):
    data = {"q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "o_ptr", "do_ptr", "x_ptr", "out_ptr", "y_ptr",
            "qn_ptr", "qr_ptr", "kn_ptr", "kr_ptr"}
    if kernel is grouped_gemm._grouped_gemm_kernel.fn:
        data.add("w_ptr")  # the expert weights; in the KDA kernels w is an fp32 intermediate
    if kernel is grouped_gemm._grouped_weight_grad_kernel.fn:
        data.update({"dy_ptr", "dw_ptr"})  # the upstream gradient and the weights' gradient
    if name in {"group_start_ptr", "group_end_ptr", "tile_expert_ptr", "tile_first_ptr"}:
        return "*i64"
    if kernel in (depth_attention._depth_forward_kernel.fn, depth_attention._depth_backward_kernel.fn):
        data.update({"w_ptr", "h_ptr", "dh_ptr", "dv_ptr"})  # the query, the output and their gradients
    if kernel is quantile_histogram._histogram_kernel.fn:  # fp64 margins and edges, int32 counts
        return {"counts_ptr": "*i32"}.get(name, "*fp64")
    return f"*{dtype}" if name in data else "*fp32"


def compile_one(kernel, dtype, constexprs, **options):
    scalars = {"scale": "fp32", "alpha": "fp32", "eps": "fp32"}
    signature = {name: "constexpr" if name in constexprs else
                 pointer_type(name, dtype, kernel) if name.endswith("_ptr") else scalars.get(name, "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                              options=options)
    return {"kernel": kernel.__name__, "dtype": dtype, "shared": compiled.metadata.shared,
            "cubin": "cubin" in compiled.asm}


results = []
for dtype in ("fp32", "bf16"):
    low = dtype != "fp32"
    chunk = {"BT": 64, "BK": 128, "BV": 64, "LOW_PRECISION": low}
    results.append(compile_one(kda_chunk._chunk_cumsum_kernel, dtype, {"BT": 64, "BK": 128}))
    results.append(compile_one(kda_chunk._intra_chunk_kernel, dtype, {"BT": 64, "BC": 16, "BK": 128}))
    results.append(compile_one(kda_chunk._wy_kernel, dtype, chunk))
    results.append(compile_one(kda_chunk._state_kernel, dtype, dict(chunk, BV=32, USE_INITIAL_STATE=True,
                               STORE_FINAL_STATE=True), num_stages=kda_chunk.STATE_KERNEL_STAGES))
    results.append(compile_one(kda_chunk._output_kernel, dtype, chunk))
    backward_stages = kda_chunk_backward.BACKWARD_STAGES
    results.append(compile_one(kda_chunk_backward._reverse_state_kernel, dtype, dict(
        chunk, BV=32, USE_FINAL_STATE_GRADIENT=True, STORE_INITIAL_STATE_GRADIENT=True), num_stages=backward_stages))
    results.append(compile_one(kda_chunk_backward._chunk_gradient_kernel, dtype, dict(
        chunk, BK=kda_chunk_backward.GRADIENT_KEY_BLOCK), num_stages=backward_stages))
    results.append(compile_one(kda_decode._decode_kernel, dtype, {"BK": 128, "BV": 32}))
    attention = {"BM": 64 if low else 32, "BN": 64 if low else 32, "BDN": 128, "BDE": 64, "BDV": 128,
                 "LOW_PRECISION": low}  # K3's heads: 128 NoPE + 64 rope, values 128; the launcher's tiles
    for kernel in (flash_mla._forward_kernel, flash_mla._key_grad_kernel, flash_mla._query_grad_kernel):
        results.append(compile_one(kernel, dtype, attention, num_stages=flash_mla.ATTENTION_STAGES))
    grouped = ((grouped_gemm._grouped_gemm_kernel, {"BM": 64}), (grouped_gemm._grouped_weight_grad_kernel, {}))
    for kernel, tile in grouped:
        for config in kernel.configs if low else kernel.configs[:1]:  # every autotune config in bf16, one in fp32
            constexprs = dict(config.kwargs, **tile, EXACT_FP32=not low)
            results.append(compile_one(kernel.fn, dtype, constexprs, num_warps=config.num_warps,
                                       num_stages=config.num_stages))
    for width, tokens, warps in ((8192, 1, 8), (1024, 2, 4)):  # K3's D = 7168; a course preset's
        for kernel in (depth_attention._depth_forward_kernel, depth_attention._depth_backward_kernel):
            results.append(compile_one(kernel, dtype, {"BT": tokens, "BD": width}, num_warps=warps))
results.append(compile_one(quantile_histogram._histogram_kernel, "fp64", {"BM": 32, "BN": 64, "SEARCH_STEPS": 9}))
results.append(compile_one(basics._decayed_kk_tile_kernel, "fp32", {"BC": 16, "BK": 128}))
results.append(compile_one(basics._matmul_kernel, "fp32", {"BM": 16, "BN": 16, "BK": 16}))
results.append(compile_one(worked_attention._one_query_kernel, "fp32", {"BS": 16, "BD": 128, "BDV": 128}))
print(json.dumps(results))
'''

H100_SHARED_BYTES = 232448  # the most shared memory one program (CTA) may use on sm_90


@pytest.fixture(scope="module")
def compiled():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("this Triton install has no ptxas to compile for a GPU")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_to_a_cubin_for_sm90(compiled):
    names = {row["kernel"] for row in compiled}
    assert {"_chunk_cumsum_kernel", "_intra_chunk_kernel", "_wy_kernel", "_state_kernel", "_output_kernel",
            "_reverse_state_kernel", "_chunk_gradient_kernel", "_decode_kernel", "_grouped_gemm_kernel",
            "_grouped_weight_grad_kernel", "_forward_kernel", "_key_grad_kernel", "_query_grad_kernel",
            "_one_query_kernel", "_depth_forward_kernel", "_depth_backward_kernel", "_histogram_kernel"} <= names
    assert all(row["cubin"] for row in compiled)


def test_every_kernel_fits_in_shared_memory(compiled):
    too_big = [row for row in compiled if row["shared"] > H100_SHARED_BYTES]
    assert not too_big, too_big
