"""A whole training step reads nothing back to the host: the tiny K3 with quantile balancing, one process.

The counted region is :meth:`k3course.train.Stepper.step_on_device`: the forward and backward of every
micro-batch, ``clip_grad_norm_``, the AdamW step, the scheduler and every MoE layer's bias update (quantile
balancing). Its record (loss, gradient norm, max-violations) stays in device tensors; ``Stepper()`` and
``train_step`` then read it back in ONE ``Tensor.tolist`` (:func:`k3course.train.step.read_record`), after the step and
outside the counted region: the one host read per step, which the training loop logs. The experts run the grouped
GEMM an accelerator runs (``torch._grouped_mm``, the group offsets on the device), not the CPU's eager per-expert
loop, which needs each expert's rows as Python ints (one ``tolist`` per MoE forward, tests/test_moe_host_reads.py).

A host read (``.item()``, ``float(t)``, ``bool(t)``) is one ``aten._local_scalar_dense`` call (helpers.HostReads);
``Tensor.tolist`` reads without that op and is counted apart. Two reads touch host memory on every device, so they
are no synchronisation and are not counted: AdamW's step counters (``state["step"]``: torch keeps them on the
host unless ``capturable=True`` and reads them for the bias correction), and the model's token-id check, which on
the CPU reads the ids with NumPy (on an accelerator it is ``torch._assert_async``, which waits for nothing). On
CUDA the same step runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from helpers import HostReads

from k3course import train
from k3course.config import K3Config
from k3course.train.step import (
    balance_experts,
    balance_experts_on_device,
    compile_for_training,
    read_record,
    step_on_device,
    training_compile_options,
)

TINY = K3Config.preset("tiny")
STEP = train.TrainConfig(steps=3, batch_size=2, seq_len=32, grad_accum=2, warmup_steps=1, grad_clip=0.5)
TOKENS = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).numpy().astype("uint8")


def tiny_stepper(device: str = "cpu", kernels: str = "auto") -> train.Stepper:
    """The tiny K3's :class:`~k3course.train.Stepper` on ``device``, built with the kernel backend ``kernels``."""
    return train.Stepper(TINY, STEP, train.text_batches(TOKENS, STEP, device), device,
                         model_factory=functools.partial(train.build_model, kernels=kernels))


def is_adamw_step_counter(optimizer: torch.optim.Optimizer):
    """tensor → whether it is one of ``optimizer``'s step counters (looked up when asked: AdamW makes them lazily)."""
    return lambda tensor: any(tensor is state.get("step") for state in optimizer.state.values())


def host_reads(fn, ignored) -> tuple[int, int, object]:
    """(scalar host reads, ``Tensor.tolist`` calls, what ``fn()`` returned)."""
    tolist_calls = []
    original = torch.Tensor.tolist

    def counted_tolist(tensor):
        tolist_calls.append(tuple(tensor.shape))
        return original(tensor)

    with mock.patch.object(torch.Tensor, "tolist", counted_tolist), HostReads(ignored) as reads:
        result = fn()
    return reads.count, len(tolist_calls), result


def test_the_tiny_preset_balances_by_quantiles():
    assert TINY.balancing == "quantile" and TINY.n_moe_layers > 0


def test_a_whole_training_step_reads_nothing_back():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    stepper = tiny_stepper(kernels="torch")
    ignored = is_adamw_step_counter(stepper.optimizer)
    for step in range(2):  # the first step (AdamW's state made) and a later one
        reads, tolists, record = host_reads(stepper.step_on_device, ignored)
        assert (reads, tolists) == (0, 0), f"step {step}"
        assert all(isinstance(record[key], torch.Tensor) for key in ("loss", "grad_norm", "max_violation_per_layer"))
        assert record["max_violation_per_layer"].shape == (TINY.n_moe_layers,)


def test_the_counter_sees_the_reads_the_step_no_longer_makes():
    stepper = tiny_stepper()
    record = stepper.step_on_device()
    reads, tolists, _ = host_reads(lambda: float(torch.nn.utils.clip_grad_norm_(stepper.model.parameters(), 1.0))
                                   + record["loss"].item(), is_adamw_step_counter(stepper.optimizer))
    assert (reads, tolists) == (2, 0)


def test_the_record_is_read_back_in_one_transfer_with_the_numbers_of_train_step():
    on_device, read_at_once = tiny_stepper(), tiny_stepper()
    for _ in range(2):
        record = on_device.step_on_device()
        reads, tolists, numbers = host_reads(functools.partial(read_record, record), lambda tensor: False)
        assert (reads, tolists) == (0, 1)
        assert numbers == read_at_once()  # Stepper() = read_record(step_on_device()): the same floats, bit for bit
    assert numbers["max_violation"] == max(numbers["max_violation_per_layer"]) > 0
    assert numbers["grad_norm"] == record["grad_norm"].item() and numbers["loss"] == record["loss"].item()


def test_balance_experts_returns_the_device_violations_as_floats():
    reference, floats = tiny_stepper(), tiny_stepper()
    for stepper in (reference, floats):
        inputs, targets = stepper.batches(0)[0]
        stepper.model.train()(inputs, targets=targets)
    on_device = balance_experts_on_device(reference.model)
    numbers = balance_experts(floats.model)
    assert numbers["max_violation_per_layer"] == on_device.tolist()
    assert numbers["max_violation"] == on_device.max().item()
    assert all(torch.equal(a.bias, b.bias) for a, b in zip(reference.model.moe_layers(), floats.model.moe_layers()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.set_sync_debug_mode)")
def test_on_cuda_the_step_runs_under_sync_debug_mode_error():
    stepper = tiny_stepper("cuda")
    stepper()  # the first step: AdamW's state and the kernels' first launches
    batches = stepper.batches(1)  # host-to-device copies of the batches: before the step, as a loader's are
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        record = step_on_device(stepper.model, stepper.optimizer, stepper.scheduler, batches, STEP.grad_clip)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    numbers = read_record(record)
    assert numbers["loss"] > 0 and numbers["grad_norm"] > 0


@pytest.mark.parametrize(("device", "options"), [("cuda", {"mode": "reduce-overhead"}), ("cuda:1", {
    "mode": "reduce-overhead"}), ("cpu", {}), ("meta", {})])
def test_a_compiled_training_step_uses_cuda_graphs_on_cuda(device, options):
    assert training_compile_options(device) == options


def test_compile_for_training_passes_reduce_overhead_for_a_model_on_cuda():
    model = train.build_model(TINY.replace(n_layers=2), seed=0, device="meta")  # its parameters: no memory
    seen = []
    with mock.patch.object(type(model), "compile", lambda self, **options: seen.append(options)), \
            mock.patch.object(train.step, "training_compile_options", wraps=training_compile_options) as chosen:
        compile_for_training(model, STEP, backend="aot_eager")
        chosen.assert_called_once_with(torch.device("meta"))
        assert seen == [{"backend": "aot_eager"}]
        with mock.patch.object(type(next(model.parameters())), "device", torch.device("cuda")):
            compile_for_training(model, STEP, backend="aot_eager")
    assert seen[-1] == {"mode": "reduce-overhead", "backend": "aot_eager"}


def test_a_step_without_micro_batches_is_refused_by_name():
    stepper = tiny_stepper()
    with pytest.raises(ValueError, match="micro_batches must hold at least one"):
        step_on_device(stepper.model, stepper.optimizer, stepper.scheduler, [], STEP.grad_clip)
