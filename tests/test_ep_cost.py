"""Chapter 13's and 14's cost models: experts a batch touches, the roofline of a decode step, the weights a rank
holds, what a capacity factor drops, overlap and latency; the balance simulation and the forked exchange."""

from __future__ import annotations

import pytest
import torch

from k3course import accounting
from k3course.config import K3Config
from k3course.distributed import cost, run_ranks
from k3course.distributed.exchange import pad_blocks, unpad_blocks
from k3course.lessons.ep_balance import expert_loads
from k3course.lessons.ep_workers import exchange_labels

LINEAR = K3Config.preset("kimi-linear-48b")


def test_experts_touched_is_k_for_one_token_and_matches_sampled_routings():
    assert accounting.experts_touched(256, 8, 1) == pytest.approx(8)
    assert accounting.experts_touched(256, 8, 4096) == pytest.approx(256)
    generator = torch.Generator().manual_seed(0)
    batch, trials = 24, 400
    distinct = [torch.rand(batch, 64, generator=generator).topk(4, dim=1).indices.unique().numel()
                for _ in range(trials)]
    assert sum(distinct) / trials == pytest.approx(accounting.experts_touched(64, 4, batch), rel=0.02)
    with pytest.raises(ValueError, match="top_k must be at most"):
        accounting.experts_touched(4, 8, 1)


def test_a_decode_step_reads_the_touched_experts_and_every_sequences_cache():
    """Weights once per step (one embedding row per sequence, not the table), caches once per sequence."""
    count = accounting.param_count(LINEAR)
    table = count.components["embedding"][1]
    one = accounting.decode_step_bytes(LINEAR, 4096, 1)
    assert one == pytest.approx(2 * (count.active - table + LINEAR.d_model) + accounting.kv_cache_bytes(LINEAR, 4096))
    everything = accounting.decode_step_bytes(LINEAR, 4096, 100_000)  # every expert touched; 100,000 rows looked up
    rows_not_read = (LINEAR.vocab_size - 100_000) * LINEAR.d_model
    caches = 100_000 * accounting.kv_cache_bytes(LINEAR, 4096)
    assert everything == pytest.approx(2 * (count.total - rows_not_read) + caches)


def test_the_roofline_is_the_slower_of_reading_and_computing():
    bytes_bound = accounting.predicted_tpot_s(LINEAR, 4096, 1, 4.8e12, 989e12)
    assert bytes_bound == pytest.approx(accounting.decode_step_bytes(LINEAR, 4096, 1) / 4.8e12)
    flops_bound = accounting.predicted_tpot_s(LINEAR, 4096, 1, 4.8e12, 1e9)
    assert flops_bound == pytest.approx(accounting.decode_flops_per_token(LINEAR, 4096) / 1e9)


def test_weights_per_rank_split_the_experts_and_replicate_the_rest():
    total = accounting.param_count(LINEAR).total * 2
    alone = cost.weight_bytes_per_rank(LINEAR, 1)
    assert alone["experts"] + alone["replicated"] == total
    one_each = cost.weight_bytes_per_rank(LINEAR, LINEAR.n_routed_experts)
    assert one_each["experts"] * LINEAR.n_routed_experts == alone["experts"]
    assert cost.weight_bytes_per_rank(LINEAR, 3)["experts"] * 3 > alone["experts"]  # blocks of ⌈256/3⌉ = 86


def test_a_capacity_drops_the_slots_above_it():
    assert cost.capacity_drop_fraction(torch.tensor([4, 4, 4, 4]), 1.0) == 0.0
    assert cost.capacity_drop_fraction(torch.tensor([10, 2, 2, 2]), 1.0) == pytest.approx(6 / 16)
    assert cost.capacity_drop_fraction(torch.tensor([10, 2, 2, 2]), 2.0) == pytest.approx(2 / 16)


def test_overlap_hides_the_faster_stage_and_latency_is_paid_per_exchange():
    assert cost.overlapped_seconds(3.0, 1.0, 1) == 4.0
    assert cost.overlapped_seconds(3.0, 1.0, 4) == 3.25
    assert cost.all_to_all_seconds(0, 3584, 16, 896, 64, 8, latency_s=2e-5) == pytest.approx(4e-5)
    assert cost.expert_seconds(1, 10, 20, 2, 1.0) == 2 * 6 * 10 * 20


def test_the_balance_simulation_records_every_slot():
    loads = expert_loads("quantile", steps=2, tokens=64)
    assert loads.shape == (2, 32) and loads.sum(1).tolist() == [64 * 4, 64 * 4]


def test_a_forked_exchange_delivers_each_block_to_its_rank_in_source_order():
    counts = [[1, 2, 0], [0, 0, 3], [2, 1, 1]]
    received = run_ranks(exchange_labels, 3, counts, start_method="fork", timeout_s=60)
    assert received[0] == [(0, 0), (2, 0), (2, 1)]
    assert received[1] == [(0, 1), (0, 2), (2, 2)]
    assert received[2] == [(1, 0), (1, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="start_method"):
        run_ranks(exchange_labels, 2, counts, start_method="forkserver")


# a rank that sends and receives nothing (rank 1), and empty blocks between the others
EMPTY_RANK = [[1, 0, 2], [0, 0, 0], [2, 0, 1]]
EMPTY_RANK_RECEIVES = [[(0, 0), (2, 0), (2, 1)], [], [(0, 1), (0, 2), (2, 2)]]


def test_the_guard_pads_every_block_by_one_row_and_drops_it_again():
    rows = torch.arange(10.0).reshape(5, 2)
    padded = pad_blocks(rows, [2, 0, 3])
    assert padded.shape == (8, 2) and padded[[0, 3, 4]].abs().sum() == 0  # a zero row in front of each block
    assert torch.equal(padded[[1, 2, 5, 6, 7]], rows) and torch.equal(unpad_blocks(padded, [2, 0, 3]), rows)
    assert unpad_blocks(pad_blocks(rows[:0], [0, 0]), [0, 0]).shape == (0, 2)


def test_the_guarded_exchange_on_gloo_delivers_what_the_plain_one_does_also_to_and_from_an_empty_rank():
    """NCCL's exchanges are guarded (no empty split, no empty buffer); the guard's logic runs on gloo here."""
    assert run_ranks(exchange_labels, 3, EMPTY_RANK, True, start_method="fork", timeout_s=60) == EMPTY_RANK_RECEIVES


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs (NCCL)")
def test_the_exchange_on_nccl_with_an_empty_rank():
    assert run_ranks(exchange_labels, 3, EMPTY_RANK, backend="nccl", timeout_s=120) == EMPTY_RANK_RECEIVES


def test_what_a_k3_rank_holds_and_moves_in_each_layout():
    """Replicated DP × EP holds every non-expert weight; FSDP2 × EP and FSDP2 alone hold 1/N of everything and
    differ in bytes moved: FSDP2 alone all-gathers the experts, FSDP2 × EP moves tokens. One rank moves nothing."""
    k3 = K3Config.preset("kimi-k3")
    assert cost.replicated_training_bytes_per_rank(k3, 1) == cost.training_bytes_per_rank(k3, 1, 1)
    assert cost.step_collective_bytes(k3, 1, 1, 4096) == {"all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}
    fsdp, fsdp_ep = cost.training_bytes_per_rank(k3, 256, 1), cost.training_bytes_per_rank(k3, 4, 64)
    assert fsdp == pytest.approx(fsdp_ep) and sum(fsdp.values()) < sum(
        cost.replicated_training_bytes_per_rank(k3, 64).values()) / 9
    alone, mesh = cost.step_collective_bytes(k3, 256, 1, 4096), cost.step_collective_bytes(k3, 4, 64, 4096)
    assert alone["all-to-all"] == 0 and alone["all-gather"] > 30 * mesh["all-gather"]
    assert mesh["all-gather"] == 2 * mesh["reduce-scatter"]  # bf16 both ways; gathered twice, reduced once
    latent_rows = 2 * k3.n_moe_layers * 4096 * cost.bytes_per_token(k3.latent_dim, k3.top_k, k3.n_routed_experts, 64)
    assert mesh["all-to-all"] == latent_rows
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        cost.step_collective_bytes(k3, 1, 1, 0)
