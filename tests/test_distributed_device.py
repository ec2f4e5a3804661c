"""Expert parallelism keeps every tensor on its layer's device: one rank in this process, gloo on the CPU and NCCL on
a GPU (skipped without CUDA), forward, backward, the data-parallel gradient steps and the bias update.

A tensor made without ``device=`` lands on the CPU whatever the layer's device: on a GPU that is a host tensor in a
device op (an error) or a hidden copy. :class:`MadeOffDevice` records every factory call without ``device=`` and
every explicit trip to the host, with the package line that made it, so the CPU run already finds them.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from k3course.distributed import average_gradients, clip_global_grad_norm, gather_state_dict, parallelize_experts
from k3course.lessons.ep_workers import build_layer

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.linspace, torch.eye, torch.randn, torch.rand, torch.randint}
HOST_TRIPS = {"cpu", "numpy", "tolist"}
CASES = [dict(kind=kind, d=16, n=8, k=3, d_expert=8, seed=0, balancing=balancing, dedup=dedup)
         for kind in ("moe", "latent") for balancing in ("quantile", "sign") for dedup in (False, True)]


class MadeOffDevice(TorchFunctionMode):
    """Records (what, package file:line) for each factory call without ``device=`` and each ``.cpu()``,
    ``.numpy()`` or ``.tolist()`` made while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if (func in FACTORIES and "device" not in kwargs) or name in HOST_TRIPS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/k3course/" in f.filename]
            where = f"{frames[-1].filename.split('/k3course/')[-1]}:{frames[-1].lineno}" if frames else "outside"
            self.calls.append((name, where))
        return func(*args, **kwargs)


class OffDeviceOutputs(TorchDispatchMode):
    """The ops that returned a tensor off ``device`` while active (by name, each once)."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.ops = torch.device(device).type, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(t.device.type != self.device for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            self.ops.add(str(func.overloadpacket.__name__))
        return out


# what a device→host read of split sizes (``.tolist()`` on a GPU tensor) runs: a copy into a host tensor
HOST_COPY_OPS = {"_to_copy", "copy_", "empty", "empty_strided"}


def _one_rank_step(case: dict, device: str) -> tuple[MadeOffDevice, set[str]]:
    """Build the case's layer on ``device``, make it expert-parallel over the (one-rank) default group, and run
    forward, backward, average_gradients, clip_global_grad_norm, update_bias and gather_state_dict under the two
    modes; checks the output equals the plain layer's (one rank holds every expert). Returns the factories and host
    trips seen, and the ops that returned a tensor off ``device``."""
    plain = build_layer(case).to(device)
    layer = parallelize_experts(build_layer(case).to(device), dedup=case["dedup"])
    x = torch.randn(13, case["d"], generator=torch.Generator().manual_seed(1)).to(device)
    with MadeOffDevice() as made, OffDeviceOutputs(device) as outputs:
        y = layer(x)
        y.square().sum().backward()
        average_gradients(layer)
        clip_global_grad_norm(layer, 1.0)
        layer.update_bias()
        state = gather_state_dict(layer)
    torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-6)
    assert all(tensor.device == x.device for tensor in state.values())
    assert all(p.grad.device == x.device for p in layer.parameters() if p.grad is not None)
    return made, outputs.ops


def _run_on_one_rank(backend: str, device: str, folder: Path) -> None:
    """Every case on a one-rank group of ``backend`` (file:// rendezvous in ``folder``); the checks above."""
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    try:
        for case in CASES:
            made, off_device = _one_rank_step(case, device)
            assert off_device <= HOST_COPY_OPS, (case, off_device)  # only the host reads of split sizes leave it
            in_distributed = [call for call in made.calls if call[1].startswith("distributed/")]
            host_splits = [call for call in in_distributed if call[0] == "tolist"]
            # all_to_all_single takes host split sizes: one read per exchange plan (dedup plans twice), nothing else
            assert len(host_splits) == 1 + case["dedup"], (case, in_distributed)
            assert in_distributed == host_splits, (case, in_distributed)
            factories = [call for call in made.calls if call[0] not in HOST_TRIPS]
            assert factories == [], (case, factories)  # nowhere in the package, moe/ included
    finally:
        dist.destroy_process_group()


def test_on_one_gloo_rank_no_tensor_is_made_off_the_layers_device(tmp_path):
    _run_on_one_rank("gloo", "cpu", tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_on_one_nccl_rank_every_tensor_is_on_the_gpu(tmp_path):
    torch.cuda.set_device(0)
    _run_on_one_rank("nccl", "cuda", tmp_path)


def test_the_modes_see_a_tensor_made_without_a_device_and_one_made_elsewhere():
    with MadeOffDevice() as made:
        torch.arange(3)
        torch.zeros(2, device="cpu")
        torch.ones(2).tolist()
    assert [name for name, _ in made.calls] == ["arange", "ones", "tolist"]
    x = torch.ones(2, device="meta")
    with OffDeviceOutputs("meta") as off:
        (x + 1).sum()
        torch.zeros(2)
    assert off.ops == {"zeros"}
