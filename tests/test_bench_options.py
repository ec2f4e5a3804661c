"""Every benchmark takes the shared options from one helper (``k3course.bench.add_options``), with its own
defaults, and applies them with ``apply_options``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import pytest
import torch

from k3course import bench
from k3course.bench import add_options, apply_options

BENCHES = sorted(module.name for module in pkgutil.iter_modules(bench.__path__))
HELP = "torch CPU threads (0: torch's default; default"  # the helper's wording of --threads


def help_text(name: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"k3course.bench.{name}").main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_benchmarks_are_the_known_ones():
    assert BENCHES == ["decode", "ep", "gpu", "kda", "kernels", "moe", "step", "train"]


@pytest.mark.parametrize("name", BENCHES)
def test_every_benchmark_takes_the_shared_options(name, capsys):
    text = " ".join(help_text(name, capsys).split())  # argparse wraps the help
    assert "--threads" in text and HELP in text and "--return-freed-memory" in text, name


@pytest.mark.parametrize("name, repeats, rounds", [("kda", 5, 3), ("moe", 3, 5), ("step", 3, 3), ("train", 3, 3),
                                                   ("ep", 5, None)])
def test_timed_benchmarks_give_their_own_repeats_and_rounds(name, repeats, rounds, capsys):
    text = " ".join(help_text(name, capsys).split())
    assert f"the best reported (default {repeats})" in text
    assert ("--rounds" in text) == (rounds is not None)
    if rounds is not None:
        assert f"each timing every variant in turn (default {rounds})" in text


def test_the_options_parse_check_and_apply():
    parser = argparse.ArgumentParser()
    add_options(parser, threads=2, repeats=4)
    args = parser.parse_args([])
    assert (args.threads, args.repeats, args.return_freed_memory) == (2, 4, False) and "rounds" not in args
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "-1"])
    before = torch.get_num_threads()
    try:
        said = apply_options(1, return_freed_memory=True)  # leave pytest's allocator alone
        assert torch.get_num_threads() == 1 and said.startswith("1 CPU thread(s); ") and "returned to the OS" in said
    finally:
        torch.set_num_threads(before)
