"""The benchmarks' page-fault counter and their allocator switch (keep freed memory in the process)."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap

import pytest

from k3course.bench import page_faults_per_call

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts and glibc's malloc: Linux")


@linux_only
def test_page_faults_per_call_counts_the_pages_a_call_maps_in():
    pages = 512

    def touch_fresh_memory():  # an anonymous mapping is mapped in page by page on first touch
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
            for offset in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
                memory[offset] = 1

    assert page_faults_per_call(touch_fresh_memory) >= 0.9 * pages
    assert page_faults_per_call(lambda: None) < 0.1 * pages


@linux_only
def test_keep_freed_memory_lets_freed_tensors_be_reused_without_page_faults():
    # in a fresh process: the setting is process-wide
    script = textwrap.dedent("""
        import torch
        from k3course.bench import page_faults_per_call
        from k3course.device import keep_freed_memory
        assert keep_freed_memory()
        work = lambda: [torch.ones(1 << 20) * 2 for _ in range(4)]  # 4 MB temporaries, freed after each call
        print(min(page_faults_per_call(work) for _ in range(3)))  # steady state: the best of three counts
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 64, "freed 4 MB tensors must come back without fresh pages"


@linux_only
@pytest.mark.parametrize("bench", ["kda", "moe"])
def test_the_benchmarks_report_page_faults_and_the_allocator_setting(bench):
    small = {"kda": ["--lengths", "32", "64", "--recurrent-length", "32", "--heads", "1", "--dim", "8",
                     "--repeats", "1", "--rounds", "1", "--chunk-size", "16"],
             "moe": ["--m", "64", "--n", "8", "--k", "2", "--d", "32", "--latent", "16", "--expert-dim", "16",
                     "--repeats", "1", "--rounds", "1", "--loop-tokens", "8"]}[bench]
    for flag, setting in (([], "freed memory kept in the process"), (["--return-freed-memory"], "returned to the OS")):
        result = subprocess.run([sys.executable, "-m", "k3course.cli", "bench", bench, *small, *flag],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "page faults per call: " in result.stdout and setting in result.stdout
