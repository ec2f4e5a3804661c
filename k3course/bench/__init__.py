"""Benchmarks, one module per topic, each with ``main(options: list[str]) -> int``; run as
``k3course bench <module>``. They print times measured in one run and ratios between them."""
