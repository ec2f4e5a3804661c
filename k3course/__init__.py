"""k3course: rebuild Kimi K3 from naive NumPy to Triton kernels.

Import the finished parts from their modules (``k3course.moe``, ``k3course.attention``, ...); the
notebooks in ``notebooks/`` walk through each one.
"""

__version__ = "0.1.0"
