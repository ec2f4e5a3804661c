"""``k3course doctor``: what this machine has, and what it unlocks in the course."""

from __future__ import annotations

import importlib.metadata
import platform


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> list[tuple[str, str]]:
    """(item, value) rows describing the environment; importing this switches Triton's mode first."""
    import torch

    from k3course.kernels import TRITON_MODE  # must precede any kernel import

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    oracle = _version("fla-core") or _version("flash-linear-attention")
    rows = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("triton", _version("triton") or "not installed"),
        ("numpy", _version("numpy") or "not installed"),
        ("device", "cuda" if gpus else "cpu"),
        ("cuda / GPUs", f"{torch.version.cuda or 'none'} / {gpus}" + (f" ({torch.cuda.get_device_name(0)})"
                                                                      if gpus else "")),
        ("triton mode", TRITON_MODE),
        ("oracle (fla)", oracle or "not installed: pip install -e '.[oracle]'"),
        ("torch._grouped_mm", "yes" if hasattr(torch, "_grouped_mm") else "no (per-expert loop fallback)"),
    ]
    unlocks = ["every notebook and exercise (CPU)"]
    unlocks.append("Triton kernels " + {"native": "compiled on the GPU, benchmarks real",
                                        "interpreter": "under the interpreter (fp32, small shapes)",
                                        "unavailable": "skipped (triton not installed)"}[TRITON_MODE])
    unlocks.append("expert parallelism on " + (f"NCCL with {gpus} GPUs" if gpus > 1 else "gloo, CPU processes"))
    if oracle:
        unlocks.append("independent checks against fla's naive KDA / GDN references")
    rows.append(("unlocks", "; ".join(unlocks)))
    return rows


def main() -> int:
    for item, value in report():
        print(f"{item:>18}  {value}")
    return 0
