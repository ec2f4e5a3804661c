"""Expert parallelism on gloo: P CPU processes give the single-process MoE's outputs, gradients and biases.

Each world size is one spawned group running many cases (spawning costs seconds); the comparisons run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3course.distributed import (
    RankFailed,
    combine,
    dispatch_permutation,
    expert_ranges,
    inverse_permutation,
    parallelize_experts,
    run_ranks,
    split_sizes,
    traffic_bytes,
)
from k3course.lessons.ep_workers import build_layer, failing, global_batch, run_cases, threads_at_exit
from k3course.moe import MoE, quantile_balance_bias, quantile_balance_bias_from_histograms, sign_rule_update
from k3course.moe.balancing import quantile_margins

BASE = dict(kind="moe", d=16, n=8, k=3, d_expert=8, seed=0)


def _cases(counts: list[int], hot: float = 0.0) -> list[dict]:
    """MoE and LatentMoE, naive and deduplicated dispatch, then quantile and sign balancing, on these counts, and
    quantile balancing with every expert chosen (k = n, a bias that is not mean-centred)."""
    forward = [{**BASE, "kind": kind, "dedup": dedup, "counts": counts, "hot": hot}
               for kind in ("moe", "latent") for dedup in (False, True)]
    balancing = [{**BASE, "test": "balancing", "balancing": rule, "counts": counts, "steps": 2, "bins": 64}
                 for rule in ("quantile", "sign")]
    every_expert = {**balancing[0], "k": BASE["n"], "hot": 0.5}
    return forward + balancing + [every_expert]


WORLDS = {1: _cases([13]), 2: _cases([9, 14]), 3: _cases([7, 0, 12], hot=0.5), 4: _cases([5, 11, 0, 8], hot=1.0)}
QUANTILE, SIGN, EVERY_EXPERT = 4, 5, 6  # the balancing cases' places in each world's list


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda p: f"P={p}")
def world(request):
    """(P, cases, results[rank][case]) from one P-rank gloo group."""
    cases = WORLDS[request.param]
    return request.param, cases, run_ranks(run_cases, request.param, cases, timeout_s=240)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _single_process(case: dict) -> tuple[torch.Tensor, MoE]:
    layer = build_layer(case)
    x, g = global_batch(case)
    y = layer(x)
    (g * y).sum().backward()
    return y.detach(), layer


def test_forward_and_gradients_equal_one_process(world):
    P, cases, results = world
    for index, case in enumerate(cases[:4]):
        y, layer = _single_process(case)
        got = [rank_results[index] for rank_results in results]
        assert _relative(torch.cat([r["y"] for r in got]), y) <= 1e-5, case
        for name, param in layer.named_parameters():
            if name.startswith("experts."):  # each rank holds the gradient of its own experts
                for r in got:
                    start, end = r["local_expert_range"]
                    assert _relative(r["grads"][name], param.grad[start:end]) <= 1e-5, (case, name)
            else:  # replicated: the sum of the ranks' contributions (the all-reduce)
                assert _relative(sum(r["grads"][name] for r in got), param.grad) <= 1e-5, (case, name)


def test_the_parallel_layer_keeps_the_plain_layers_names_with_its_block_of_experts(world):
    P, cases, results = world
    for index, case in enumerate(cases[:4]):
        plain = build_layer(case)
        assert [name for name, _ in plain.named_parameters()] == list(results[0][index]["grads"])
        for r in (rank_results[index] for rank_results in results):
            start, end = r["local_expert_range"]
            assert list(r["shapes"]) == list(plain.state_dict()), case
            for name, tensor in plain.state_dict().items():
                block = (end - start, *tensor.shape[1:]) if name.startswith("experts.") else tuple(tensor.shape)
                assert r["shapes"][name] == block, (case, name)


def test_load_statistics_pool_the_ranks_into_the_one_process_statistics(world):
    P, cases, results = world
    for index, case in enumerate(cases[:4]):
        _, layer = _single_process(case)
        want = layer.load_statistics()
        for r in (rank_results[index] for rank_results in results):
            got = r["routing"]
            assert torch.equal(got["load"], want["load"]) and got["tokens"] == want["tokens"], case
            assert got["max_violation"] == want["max_violation"] and got["entropy"] == want["entropy"], case


def test_a_rank_with_zero_tokens_and_uneven_loads(world):
    P, cases, results = world
    counts = cases[0]["counts"]
    if 0 in counts:
        assert results[counts.index(0)][0]["y"].shape == (0, BASE["d"])
    received = [r[0]["traffic"]["combine"] for r in results]  # bytes each rank's experts sent back
    assert len(set(received)) == P  # every rank received a different number of rows


def test_dedup_gives_identical_results(world):
    P, cases, results = world
    for naive, dedup in ((0, 1), (2, 3)):
        for r in results:
            assert torch.equal(r[naive]["y"], r[dedup]["y"])
            for name, grad in r[naive]["grads"].items():
                assert torch.allclose(r[dedup]["grads"][name], grad, rtol=1e-5, atol=1e-6), name
    sent = [sum(r[index]["traffic"]["dispatch"] for r in results) for index in (0, 1)]
    if P == 1:
        assert sent == [0, 0]  # one rank: no row crosses to another
    else:
        assert sent[1] < sent[0]  # with k = 3 of 8 experts some tokens have two experts on one rank


def test_counted_bytes_equal_the_accounting(world):
    P, cases, results = world
    for index, case in enumerate(cases[:4]):
        width = case["d"] // 2 if case["kind"] == "latent" else case["d"]
        for rank, rank_results in enumerate(results):
            r = rank_results[index]
            expected = traffic_bytes(r["expert_idx"], case["n"], P, rank, width, 4, dedup=case["dedup"])
            assert r["traffic"] == expected, (case, rank)


def test_bias_identical_on_every_rank_and_equal_to_the_pooled_histogram(world):
    """Pooled over 1–4 gloo ranks (a rank without tokens included) = the one-process histogram routine on the
    concatenated scores, bit for bit; k = n included."""
    P, cases, results = world
    for step in range(2):
        for index in (QUANTILE, SIGN, EVERY_EXPERT):
            biases = [r[index]["bias_after"][step] for r in results]
            assert all(torch.equal(b, biases[0]) for b in biases), (index, step)
        for index in (QUANTILE, EVERY_EXPERT):
            before = results[0][index]["bias_before"][step]
            shards = [r[index]["scores"][step] for r in results]
            k, bins = cases[index]["k"], cases[index]["bins"]
            pooled = quantile_balance_bias_from_histograms(shards, before, k, bins)
            assert torch.equal(results[0][index]["bias_after"][step], pooled), (index, step)
        before = results[0][QUANTILE]["bias_before"][step]
        scores = torch.cat([r[QUANTILE]["scores"][step] for r in results])
        margins = quantile_margins(scores, before, BASE["k"])
        bin_width = float(margins.max() - margins.min()) / cases[QUANTILE]["bins"]
        exact = quantile_balance_bias(scores, before, BASE["k"])
        assert float((results[0][QUANTILE]["bias_after"][step] - exact).abs().max()) <= bin_width
        load = sum(r[SIGN]["load"][step] for r in results)
        sign_before = results[0][SIGN]["bias_before"][step]
        expected = sign_rule_update(sign_before, load, build_layer(cases[SIGN]).balancer.gamma)
        assert torch.equal(results[0][SIGN]["bias_after"][step], expected)


def test_bias_after_an_update_matches_one_process_on_the_concatenated_batch(world):
    P, cases, results = world
    for index, tolerance in ((QUANTILE, "one bin"), (SIGN, "exact"), (EVERY_EXPERT, "exact")):
        layer = build_layer(cases[index])
        layer(global_batch(cases[index])[0])
        layer.update_bias()
        got = results[0][index]["bias_after"][0]
        if tolerance == "exact":  # the sign rule (integer loads, summed exactly), and k = n (b − mean b)
            assert torch.equal(got, layer.bias), index
        else:
            margins = quantile_margins(torch.cat([r[index]["scores"][0] for r in results]), torch.zeros(BASE["n"]),
                                       BASE["k"])
            bin_width = float(margins.max() - margins.min()) / cases[index]["bins"]
            assert float((got - layer.bias).abs().max()) <= bin_width
    every_expert = results[0][EVERY_EXPERT]
    assert not torch.equal(every_expert["bias_after"][0], every_expert["bias_before"][0])  # the bias was centred


def test_split_sizes_permutation_and_combine():
    expert_idx = torch.tensor([[5, 0], [2, 7], [0, 3]])  # 3 tokens, k = 2, n = 8 experts on P = 3 ranks
    assert expert_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_sizes(expert_idx, 8, 3).tolist() == [3, 2, 1]
    order = dispatch_permutation(expert_idx)
    assert order.tolist() == [1, 4, 2, 5, 0, 3]  # slots of experts 0, 0, 2, 3, 5, 7
    assert torch.equal(order[inverse_permutation(order)], torch.arange(6))
    returned = torch.arange(6.0)[:, None]  # row r came back holding r
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    assert combine(returned, order, weights).flatten().tolist() == [2.0, 2.0, 2.5]


def test_clear_errors():
    with pytest.raises(ValueError, match="world_size"):
        expert_ranges(4, 5)
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize_experts(MoE(8, 4, 2))
    with pytest.raises(TypeError, match="module must be or contain an MoE"):
        parallelize_experts(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(failing, 0, "raise")


def test_a_failing_rank_ends_the_others_with_its_error():
    with pytest.raises(RankFailed, match="(?s)rank 1 failed first.*rank 1 failed on purpose"):
        run_ranks(failing, 2, "raise", timeout_s=120)


def test_a_rank_that_dies_in_native_code_reports_its_own_stacks():
    """A rank killed by SIGABRT (as "terminate called without an active exception" kills one) leaves no Python
    traceback; RankFailed names it, its signal and where its threads were (faulthandler, in the rank)."""
    with pytest.raises(RankFailed, match="(?s)rank 1 died of SIGABRT.*Fatal Python error: Aborted.*in failing"):
        run_ranks(failing, 2, "abort", timeout_s=120, start_method="fork")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from Linux's /proc")
def test_leaving_the_group_ends_its_threads_before_the_interpreter_shuts_down(tmp_path):
    """The cause of a rank's random SIGABRT at exit: torch.distributed.nn.functional, imported by the first
    optimizer after the group exists, kept the default group alive past destroy_process_group, so gloo's threads
    were still running while the rank's interpreter shut down. Joined by join_group, no gloo thread is left."""
    run_ranks(threads_at_exit, 2, str(tmp_path), timeout_s=120)
    for rank in range(2):
        threads = (tmp_path / f"threads_{rank}.txt").read_text().split()
        assert threads and not [name for name in threads if "gloo" in name], threads


def test_a_hanging_rank_ends_the_others_within_the_collective_timeout():
    with pytest.raises(RankFailed, match="(?is)rank 0 failed first.*timed? ?out"):
        run_ranks(failing, 2, "hang", timeout_s=120, collective_timeout_s=3)


def test_bench_ep_prints_bandwidths_and_ratios(capsys):
    from k3course.bench.ep import main

    assert main(["--ranks", "2", "--m", "64", "--n", "8", "--repeats", "1", "--dedup",
                 "--return-freed-memory"]) == 0  # in-process: leave pytest's allocator alone
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("P=2:") and "GB/s" in line and "x raw" in line
    ratio = float(line.split("achieves ")[1].split("x")[0])
    assert 0 < ratio < 100


def test_one_train_step_on_two_ranks_matches_one_process_on_the_concatenated_batch():
    import dataclasses

    from k3course.config import K3Config
    from k3course.lessons.ep_workers import expert_parallel_steps
    from k3course.train import TrainConfig, build_model
    from k3course.train.step import make_optimizer, train_step

    model_config = dataclasses.replace(K3Config.preset("tiny"), balancing="sign")  # the sign rule is exact
    # in float64: the ranks sum in another order, and in float32 that rounding grows step by step (a router score
    # near a tie flips, a token changes expert; Adam turns a gradient entry that is zero up to rounding into a
    # step of ~lr) until runs on another CPU part at step 2. In float64 rounding stays far below Adam's ε.
    train_config = TrainConfig(steps=10, batch_size=4, seq_len=16, grad_accum=2, warmup_steps=1)
    tokens = torch.randint(0, 256, (10, 2, 4, 17), generator=torch.Generator().manual_seed(0))
    batches = [[(window[:, :-1], window[:, 1:]) for window in step] for step in tokens]
    case = {"model": model_config, "train": train_config, "batches": batches, "dtype": torch.float64}
    ranks = run_ranks(expert_parallel_steps, 2, case, timeout_s=240)
    model = build_model(model_config, train_config.seed).double()
    optimizer, scheduler = make_optimizer(model, train_config)
    for step in range(train_config.steps):
        want = train_step(model, optimizer, scheduler, batches[step], train_config.grad_clip)
        for rank in ranks:
            got = rank["records"][step]
            assert set(got) == set(want), step
            assert abs(got["loss"] - want["loss"]) <= 1e-9 * abs(want["loss"]), step  # both sum it in float64
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-9 * want["grad_norm"], step
            assert got["lr"] == want["lr"], step
            # the pooled integer loads are the one-process loads: max-violations equal to the last bit
            assert got["max_violation_per_layer"] == want["max_violation_per_layer"], step
            assert got["max_violation"] == want["max_violation"] > 0, step
    assert set(ranks[0]["state"]) == set(model.state_dict())  # the gathered state dict is the single-process one
    for name, tensor in model.state_dict().items():
        for rank in ranks:
            assert rank["state"][name].dtype == tensor.dtype, name
            assert torch.allclose(rank["state"][name], tensor, rtol=1e-9, atol=1e-10), name
    biases = [name for name in model.state_dict() if name.endswith("ffn.bias")]
    assert biases and all(model.state_dict()[name].abs().sum() > 0 for name in biases)  # the rule moved them
    assert all(torch.equal(rank["state"][name], model.state_dict()[name]) for name in biases
                          for rank in ranks)  # the sign rule on equal loads: the same biases


def test_train_ep_takes_the_one_process_first_step_into_a_checkpoint_the_plain_model_reads(tmp_path):
    """``k3course train --ep 2`` (the 1 × 2 mesh): the one-process first loss, and its sharded checkpoint read in
    one process into the plain model holds the one-process step's weights."""
    import json

    from k3course import data
    from k3course.cli import main
    from k3course.train import build_model
    from k3course.train.config import train_preset
    from k3course.train.generate import load_model
    from k3course.train.step import make_optimizer, train_step

    assert main(["train", "--preset", "tiny", "--steps", "1", "--ep", "2", "--out", str(tmp_path)]) == 0
    model_config, train_config = train_preset("tiny")
    model = build_model(model_config, train_config.seed)
    optimizer, scheduler = make_optimizer(model, train_config.replace(steps=1))
    batches = [data.batch_at(data.stdlib_corpus().train, j, train_config.batch_size, train_config.seq_len,
                             train_config.seed) for j in range(train_config.grad_accum)]
    want = train_step(model, optimizer, scheduler, batches, train_config.grad_clip)
    got = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"]
    loaded = dict(load_model(tmp_path).named_parameters())  # each rank's pieces, read into the plain model
    for name, param in model.named_parameters():  # (the biases come from a histogram: within a bin, not equal)
        assert float((loaded[name] - param).detach().abs().max()) <= 0.05 * train_config.lr, name
    assert main(["train", "--preset", "tiny", "--ep", "2", "--out", str(tmp_path)]) == 2  # refuses to overwrite
