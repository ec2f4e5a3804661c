"""Guard bands: catch a kernel that writes outside the tensors it is given.

Nothing stops a ``tl.store`` at a tensor's end, under Triton's interpreter or on a GPU: a store past it writes
into whatever memory follows, which may be another tensor (a wrong value far away, or none at all) or nothing
(a crash, now or when that memory is freed). While a Triton exercise's answer runs, every tensor it is given and
every tensor its own code allocates (``torch.empty``, ``empty_like``, ``zeros``, ``new_empty``, ``clone``, ...)
lives inside a larger buffer: the tensor's elements keep their shape and strides, and every other byte of the
buffer — a band before the tensor, one after it, and the gaps between a strided view's rows — holds a sentinel:
in a float tensor a NaN with a payload of its own (a load from a band poisons what it touches, and a value
computed from one tensor's band and stored into another's still differs from the sentinel there), in an integer
tensor a negative number of its own. After the call, a sentinel that changed is a write outside the tensor,
reported with the tensor, the side and how far.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from k3course.grading.forbid import GRADER_DIR, _package_dir

MIN_BAND = 1024  # elements on each side, at least; a band is as long as the tensor's span when that is longer
ALLOCATORS = frozenset({"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                        "full_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "clone"})


class OutsideWrite(Exception):
    """The answer (its kernel) wrote into a guard band: outside a tensor it was given or allocated."""


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view of each element size
QUIET_NAN = {torch.float32: 0x7FC00000, torch.float64: 0x7FF8000000000000, torch.bfloat16: 0x7FC0,
             torch.float16: 0x7E00}  # a quiet NaN's bits, payload 0 (the NaN arithmetic makes; ours add 1 + i)


def _sentinel(dtype: torch.dtype, index: int) -> int:
    """The bits the bands of the ``index``-th banded tensor of a call hold (as an integer of the element's size):
    a quiet NaN whose payload is 1 + index (up to 62: bf16 has 6 payload bits), or −(1 + index) for an integer
    tensor (0xFF for a byte-sized one)."""
    if dtype in QUIET_NAN:
        return QUIET_NAN[dtype] + 1 + index % 62
    return 0xFF if dtype.itemsize == 1 else -(1 + index)


@dataclass(frozen=True)
class _Guarded:
    """One tensor in its banded buffer: ``inside`` marks the buffer's elements that are the tensor's own, which
    lie between elements ``first`` and ``last`` (inclusive); every other element holds the bits ``sentinel``."""

    what: str
    buffer: torch.Tensor  # flat, the tensor's dtype
    inside: torch.Tensor  # bool, one per element of the buffer
    first: int
    last: int
    sentinel: int

    def outside_write(self) -> str | None:
        """How many sentinels changed and the farthest of them ('3 element(s) past its end'), or None when every
        band is intact."""
        changed = self.buffer.view(BITS[self.buffer.element_size()]) != self.sentinel
        touched = (changed & ~self.inside).nonzero().flatten()
        if touched.numel() == 0:
            return None
        before, after = self.first - int(touched[0]), int(touched[-1]) - self.last
        if after > 0:
            where = f"{after} element(s) past its end"
        elif before > 0:
            where = f"{before} element(s) before its start"
        else:
            where = "in a gap between its rows (a strided view's)"
        return f"into {touched.numel()} element(s) outside {self.what}, the farthest {where}"


def _span(tensor: torch.Tensor) -> int:
    """Elements from the view's first to its last, inclusive (strides ≥ 0); 0 for an empty tensor."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def _can_band(tensor: torch.Tensor) -> bool:
    """A tensor that can move into a banded buffer unchanged: an element size with an integer view (:data:`BITS`),
    no element shared (stride 0 over a size > 1), no autograd history to keep."""
    return (tensor.element_size() in BITS and not tensor.requires_grad
            and all(stride > 0 or size <= 1 for size, stride in zip(tensor.shape, tensor.stride())))


def _describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}"


class GuardBands:
    """The banded tensors of one call: :meth:`banded` makes them, :meth:`check` raises :class:`OutsideWrite`."""

    def __init__(self):
        self._guarded: list[_Guarded] = []

    def banded(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """A copy of ``tensor`` (same shape, strides, dtype, device and values) inside a buffer whose other bytes
        are sentinels; ``tensor`` itself when it can't be moved (:func:`_can_band`)."""
        if not _can_band(tensor):
            return tensor
        span = _span(tensor)
        band = max(MIN_BAND, span)
        buffer = torch.empty(band + span + band, dtype=tensor.dtype, device=tensor.device)
        sentinel = _sentinel(tensor.dtype, len(self._guarded))
        buffer.view(BITS[tensor.element_size()]).fill_(sentinel)
        view = buffer.as_strided(tensor.shape, tensor.stride(), band)
        view.copy_(tensor)
        inside = torch.zeros(buffer.numel(), dtype=torch.bool, device=tensor.device)
        inside.as_strided(tensor.shape, tensor.stride(), band).fill_(True)
        self._guarded.append(_Guarded(f"{what} ({_describe(tensor)})", buffer, inside, band, band + span - 1,
                                      sentinel))
        return view

    def inputs(self, args: tuple, kwargs: dict, names: list[str]) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with every tensor (also in a list or tuple) banded, named after ``names`` (the
        parameters, by position)."""
        def band(value, name):
            if isinstance(value, torch.Tensor):
                return self.banded(value, f"the input `{name}`")
            if isinstance(value, list | tuple):
                return type(value)(band(item, f"{name}[{i}]") for i, item in enumerate(value))
            return value

        named = [names[i] if i < len(names) else f"argument {i + 1}" for i in range(len(args))]
        return (tuple(band(value, name) for value, name in zip(args, named)),
                {key: band(value, key) for key, value in kwargs.items()})

    @contextmanager
    def allocating(self) -> Iterator[None]:
        """Within the block, on this thread, a tensor the learner's own code allocates comes back banded."""
        with _BandAllocations(self):
            yield

    def check(self) -> None:
        """Raise :class:`OutsideWrite` naming the first banded tensor whose bands changed."""
        for guarded in self._guarded:
            where = guarded.outside_write()
            if where is not None:
                raise OutsideWrite(f"your kernel wrote {where}: mask every tl.store (and size every grid) so "
                                   "that it stays inside its tensor")


class _BandAllocations(TorchFunctionMode):
    """Bands the result of every allocation (:data:`ALLOCATORS`) that the learner's code makes: not one that
    torch or Triton (the interpreter moves tensors with torch) or the grader makes."""

    def __init__(self, bands: GuardBands):
        super().__init__()
        self.bands = bands
        import triton  # a guarded exercise is a Triton one

        self.torch_dir, self.not_learner = _package_dir(torch), (_package_dir(triton), GRADER_DIR)

    def _made_by_learner(self) -> bool:
        """Whether the code that called the torch function, looking through torch's own frames and the refusal's
        mode (:mod:`k3course.grading.forbid`, which sees the call first), is neither Triton's nor the grader's."""
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(self.torch_dir) or (
                frame.f_code.co_filename.startswith(GRADER_DIR) and frame.f_code.co_name == "__torch_function__")):
            frame = frame.f_back
        return frame is not None and not frame.f_code.co_filename.startswith(self.not_learner)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = (getattr(func, "__name__", "") or "").strip("_")
        if name in ALLOCATORS and isinstance(result, torch.Tensor) and self._made_by_learner():
            return self.bands.banded(result, f"the tensor your code made with {name}")
        return result


@contextmanager
def guarding(bands: GuardBands | None) -> Iterator[None]:
    """:meth:`GuardBands.allocating` when ``bands`` is given, else nothing."""
    if bands is None:
        yield
        return
    with bands.allocating():
        yield
