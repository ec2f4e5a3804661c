"""Layering at run time (the floors read from the source are in test_floors.py): what one import loads, and no
side effect of importing: no environment variable, no torch setting changed. Each check runs a fresh interpreter
and inspects ``sys.modules`` / ``os.environ``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LAYERS = ("k3course.layers.kda", "k3course.layers.mla")


def loaded_after(statement: str, env: dict | None = None) -> dict:
    """Run ``statement`` in a fresh interpreter; return the k3course / triton / fla modules it loaded and
    TRITON_INTERPRET afterwards."""
    script = (f"{statement}\nimport json, os, sys\n"
              "print(json.dumps({'modules': sorted(m for m in sys.modules if m.split('.')[0] in "
              "('k3course', 'triton', 'fla')), 'interpret': os.environ.get('TRITON_INTERPRET')}))")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment.update(env or {})
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["k3course.ops", "k3course.ops.chunk", "k3course.ops.recurrent",
                                    "k3course.ops.parallel", "k3course.config", "k3course.accounting"])
def test_the_ops_and_the_config_load_no_kernel_module(module):
    """The ops (floor 2) and the config (floor 1) load neither a layer nor a Triton kernel; the accounting loads
    the layers it counts, but no kernel either (the layers import kernels only when one runs)."""
    modules = loaded_after(f"import {module}")["modules"]
    layers = [] if module == "k3course.accounting" else [m for m in modules if m in LAYERS]
    assert not layers + [m for m in modules if m.startswith("k3course.kernels.") or m.split(".")[0] == "triton"]


def test_the_config_loads_nothing_above_it():
    modules = loaded_after("import k3course.config")["modules"]
    assert set(modules) <= {"k3course", "k3course.config", "k3course.guards"}  # guards: the floor below


def test_importing_the_kernels_package_leaves_the_environment_alone():
    report = loaded_after("import k3course.kernels")
    assert report["interpret"] is None
    assert not [m for m in report["modules"] if m.startswith("k3course.kernels.") or m.split(".")[0] == "triton"]


def test_kernel_modules_select_the_mode_before_triton_loads():
    """A kernel module imported first through the package picks the mode before triton is imported: on a
    CPU-only machine that is the interpreter, and the kernel runs; the environment is left as it was."""
    pytest.importorskip("triton")
    statement = ("import torch\nfrom k3course.kernels.kda_decode import TRITON_MODE, kda_decode_triton\n"
                 "import k3course.kernels as kernels\nassert kernels.TRITON_MODE == TRITON_MODE\n"
                 "if TRITON_MODE == 'interpreter':\n"
                 "    x = torch.rand(1, 1, 1, 16)\n"
                 "    kda_decode_triton(x, x, x, -x, torch.rand(1, 1, 1), torch.zeros(1, 1, 16, 16))")
    report = loaded_after(statement)
    assert "k3course.kernels.kda_decode" in report["modules"] and report["interpret"] is None


def test_the_kernels_import_the_ops_and_nothing_imports_back():
    """The Triton chunk op imports the torch chunk op's module (its sub-chunk size) directly: no cycle through the
    layers."""
    pytest.importorskip("triton")
    modules = loaded_after("import k3course.kernels.kda_chunk")["modules"]
    assert "k3course.ops.chunk" in modules and not set(LAYERS) & set(modules)


def test_select_triton_mode_is_explicit_and_stable():
    statement = ("import k3course.kernels as k\nfirst = k.select_triton_mode()\n"
                 "assert first in ('native', 'interpreter', 'unavailable')\nassert k.select_triton_mode() == first")
    loaded_after(statement)


def test_importing_the_train_loop_bench_and_cli_leaves_triton_interpret_unset():
    loaded_after("import os, k3course.train, k3course.bench, k3course.cli\n"
                 "assert 'TRITON_INTERPRET' not in os.environ")


IMPORT_EVERY_MODULE = """
import importlib, os, pkgutil
import torch
import k3course

def settings():
    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic warn only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn deterministic": torch.backends.cudnn.deterministic,
            "cudnn benchmark": torch.backends.cudnn.benchmark,
            "matmul precision": torch.get_float32_matmul_precision(), "default device": torch.get_default_device()}

environment, before = dict(os.environ), settings()
imported = [importlib.import_module(info.name).__name__
            for info in pkgutil.walk_packages(k3course.__path__, "k3course.")]
assert len(imported) > 100 and "k3course.kernels.kda_chunk" in imported and "k3course.cli" in imported, imported
changed = sorted(key for key in set(environment) | set(os.environ) if environment.get(key) != os.environ.get(key))
assert not changed, f"importing k3course changed the environment variables {changed}"
after = settings()
assert after == before, {name: (before[name], after[name]) for name in before if before[name] != after[name]}
"""


def test_importing_every_module_changes_no_environment_variable_and_no_torch_setting():
    """Every k3course module, the kernel modules (which choose Triton's mode) included, imported in one fresh
    interpreter with TRITON_INTERPRET unset."""
    loaded_after(IMPORT_EVERY_MODULE)


def test_a_layer_forced_onto_triton_chooses_the_mode_when_it_first_runs():
    """Nothing chooses at import: a KDA layer told to use the Triton kernels (``K3COURSE_KERNELS=triton``) loads
    them on its first call, after choosing the mode (the interpreter on a CPU), and the environment stays as it was."""
    pytest.importorskip("triton")
    statement = ("import sys, torch\nfrom k3course.layers import KimiDeltaAttention\n"
                 "assert not [m for m in sys.modules if m.startswith('k3course.kernels.') or m == 'triton']\n"
                 "layer = KimiDeltaAttention(32, 2, 16)\n"
                 "with torch.no_grad():\n    y = layer(torch.randn(1, 8, 32))[0]\n"
                 "assert y.shape == (1, 8, 32)")
    report = loaded_after(statement, env={"K3COURSE_KERNELS": "triton"})
    assert "k3course.kernels.kda" in report["modules"] and report["interpret"] is None
