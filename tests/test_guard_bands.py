"""Guard bands (``k3course.grading.guard_bands``): a tensor moved between sentinel bands keeps its shape, strides
and values; a write before it, past it or into a strided view's gaps is named; every Triton exercise has them."""

from __future__ import annotations

import re

import pytest
import torch

from k3course.grading import all_exercises
from k3course.grading.chapters.ch08_triton import TORCH_MATH
from k3course.grading.guard_bands import GuardBands, OutsideWrite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_a_banded_tensor_keeps_its_shape_strides_and_values_and_its_bands_hold(dtype):
    wide = torch.arange(40).reshape(5, 8).to(dtype)
    view = wide[:, 2:6]  # rows 8 apart: a strided view
    bands = GuardBands()
    banded = bands.banded(view, "x")
    assert banded.shape == view.shape and banded.stride() == view.stride() and torch.equal(banded, view)
    banded.copy_(~view if dtype == torch.bool else view + 1)  # writes inside the tensor are its own
    bands.check()


@pytest.mark.parametrize("offset, said", [(-3, "3 element(s) before its start"), (4, "in a gap between its rows"),
                                          (5 * 8 - 4 + 2, "3 element(s) past its end")])
def test_a_write_outside_is_named_with_its_side_and_distance(offset, said):
    bands = GuardBands()
    banded = bands.banded(torch.zeros(5, 8)[:, 2:6], "the input `x`")
    torch.as_strided(banded, (1,), (1,), banded.storage_offset() + offset).fill_(7.0)
    with pytest.raises(OutsideWrite, match=rf"1 element\(s\) outside the input `x` \(shape \(5, 4\), float32\), "
                                           rf"the farthest {re.escape(said)}"):
        bands.check()


def test_a_value_read_from_one_band_and_stored_in_another_is_caught():
    """Each tensor's sentinel is a NaN of its own payload: copying one band's NaN into another changes it."""
    bands = GuardBands()
    x, y = bands.banded(torch.ones(4), "x"), bands.banded(torch.zeros(4), "y")
    just_past = lambda t: torch.as_strided(t, (1,), (1,), t.storage_offset() + 4)  # noqa: E731
    just_past(y).copy_(just_past(x) * 2)
    with pytest.raises(OutsideWrite, match="outside y"):
        bands.check()


def test_what_the_learner_allocates_is_banded_and_what_torch_makes_inside_is_not():
    bands = GuardBands()
    with bands.allocating():
        mine = torch.empty(3, 5)
        made_inside = torch.nn.functional.pad(torch.ones(2), (1, 1))  # torch's own allocation
    assert mine.storage_offset() > 0 and made_inside.storage_offset() == 0
    torch.as_strided(mine, (1,), (1,), mine.storage_offset() + 15).fill_(0.0)
    with pytest.raises(OutsideWrite, match=r"the tensor your code made with empty \(shape \(3, 5\), float32\), "
                                           r"the farthest 1 element\(s\) past its end"):
        bands.check()


def test_every_triton_exercise_has_guard_bands():
    """An exercise that refuses torch maths asks for a Triton kernel: its answers run between guard bands."""
    triton = [exercise for exercise in all_exercises().values()
              if exercise.forbidden is not None and TORCH_MATH.names <= exercise.forbidden.names]
    assert triton and all(exercise.guard_bands for exercise in triton), [e.id for e in triton if not e.guard_bands]
