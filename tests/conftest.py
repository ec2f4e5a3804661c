"""Choose Triton's mode (native on a GPU, interpreter on CPU) before any test module imports triton or fla:
the interpreter must be selected before the first ``@triton.jit`` runs (see k3course.kernels)."""

import k3course.kernels

k3course.kernels.select_triton_mode()
