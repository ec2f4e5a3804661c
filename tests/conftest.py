"""Choose Triton's mode (native on a GPU, interpreter on CPU) before any test module imports triton or fla:
the interpreter must be selected before the first ``@triton.jit`` runs (see k3course.kernels)."""

import k3course.kernels

k3course.kernels.select_triton_mode()

import pytest  # noqa: E402  (below the mode choice, which must come first)
import torch  # noqa: E402


@pytest.fixture
def same_threads():
    """Commands with --threads N set torch's thread count for the whole process: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
