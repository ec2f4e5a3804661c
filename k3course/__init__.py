"""k3course: rebuild Kimi K3 from naive NumPy to Triton kernels.

The package is a house of floors, the course's ladder: each unit (a top-level module or sub-package) imports
only units on floors below it, from the number guard (guards) and the leaves (config, data, params, the NumPy
reference) up through ops, kernels, layers and moe, the model, training, the lessons and benchmarks, to the
``k3course`` command. The map is written in one place, ``FLOORS`` in tests/test_floors.py, which checks it
against every import.

The notebooks in ``notebooks/`` walk through each floor.
"""

__version__ = "0.1.0"
