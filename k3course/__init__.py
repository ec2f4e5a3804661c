"""k3course: rebuild Kimi K3 from naive NumPy to Triton kernels.

The package is a house of floors, each importing only the floors below it (the course's ladder):

    0  config, data, device, debug, params,        K3Config and presets; corpora; parameter marks (init and
       layout, reference/                           weight decay); the released K3 layout and MXFP4; NumPy rung
    1  ops/, pretrained                             linear-attention ops, RMSNorm, input checks; transformers'
                                                    checkpoint layout (names, configs), read by K3Model
    2  kernels/                                     Triton kernels (tested against the ops)
    3  layers/, moe/                                token mixers, residual schemes; routed experts
    4  model                                        K3Model
    5  accounting, checkpoint                       costs from the dimensions; safetensors run folders
    6  distributed/                                 expert parallelism: exchanges around the expert bank
    7  train                                        the one training loop (one process or P ranks)
    8  lessons/, runs                               lesson tasks, chapter-12 claims and experiments; run folders as
                                                    a tool (evaluate a checkpoint, compare runs)
    9  bench/                                       benchmarks
    10 grading/, doctor                             the exercises' checks; what this machine unlocks
    11 cli                                          the ``k3course`` command

The notebooks in ``notebooks/`` walk through each floor.
"""

__version__ = "0.1.0"
