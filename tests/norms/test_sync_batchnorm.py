"""Per-timestep BN synchronized across 2 CPU processes (gloo) equals one process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

import seqnorm
from seqnorm.norms import TimestepBatchNorm
from seqnorm.norms.sync import SyncTimestepBatchNorm
from tests.conftest import KINDS, LAYERS, with_spec

# The long sequences all on rank 0: rank 1's input has 3 steps, so at steps 3..6 it has no active row, and at step 6
# one row is active in the whole batch (the small-batch rule must count global rows: a fallback step everywhere).
LENGTHS = [7, 6, 5, 3, 2, 3]
SHARES = [slice(0, 3), slice(3, 6)]


def _setup(kind: str, norm: str, input_stats: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    options = with_spec(norm, **({"input_stats": input_stats} if input_stats != "timestep" else {}))
    layer = LAYERS[kind](3, 4, num_layers=2, max_steps=5, dtype=torch.float64, **options)
    x = torch.randn(7, 6, 3, dtype=torch.float64)
    weights = torch.randn(7, 6, 4, dtype=torch.float64)  # the loss: a weighted sum of the outputs
    return layer, x, weights


def _step(layer: torch.nn.Module, x: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    results = {}
    for repeat in range(2):  # two training steps: the second one normalizes with running statistics at step 6
        output, _ = layer(x, lengths=lengths)
        (output * weights[: output.shape[0]]).sum().backward()
        results[f"output{repeat}"] = output.detach()
    results["input_grad"] = x.grad
    results.update({f"grad.{n}": p.grad for n, p in layer.named_parameters()})
    results.update({f"buffer.{n}": b for n, b in layer.named_buffers()})
    results["fallbacks"] = [m.fallback_steps for m in layer.modules() if isinstance(m, TimestepBatchNorm)]
    return results


def _rank(rank: int, kind: str, norm: str, input_stats: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        layer, x, weights = _setup(kind, norm, input_stats)
        seqnorm.convert_sync_batchnorm(layer)
        share = SHARES[rank]
        lengths = torch.tensor(LENGTHS[share])
        local = x[: int(lengths.max()), share]  # each process's own padded batch: rank 1's is 3 steps long
        torch.save(_step(layer, local, lengths, weights[:, share]), f"{folder}/rank{rank}.pt")
        dist.barrier()  # neither process tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kind", "norm", "input_stats"),
    [(kind, "batch", "timestep") for kind in KINDS]
    + [("lstm", "batch_renorm", "timestep"), ("gru", "batch", "sequence")],
)
def test_synchronized_halves_equal_one_process_on_the_whole_batch(
    tmp_path: Path, kind: str, norm: str, input_stats: str
) -> None:
    mp.spawn(_rank, args=(kind, norm, input_stats, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    layer, x, weights = _setup(kind, norm, input_stats)
    whole = _step(layer, x, torch.tensor(LENGTHS), weights)
    for repeat in range(2):
        for rank, share in enumerate(SHARES):
            steps = ranks[rank][f"output{repeat}"].shape[0]
            assert_close(ranks[rank][f"output{repeat}"], whole[f"output{repeat}"][:steps, share])
    for rank, share in enumerate(SHARES):
        steps = ranks[rank]["input_grad"].shape[0]
        assert_close(ranks[rank]["input_grad"], whole["input_grad"][:steps, share])
    for key, value in whole.items():
        if key.startswith("grad."):  # each process holds its share of the gradient: their sum is the whole one
            assert_close(ranks[0][key] + ranks[1][key], value, msg=key)
        elif key.startswith("buffer."):  # running statistics: identical everywhere, those of the global batch
            assert torch.equal(ranks[0][key], ranks[1][key]), key
            assert_close(ranks[0][key], value, msg=key)
    assert ranks[0]["fallbacks"] == ranks[1]["fallbacks"] == whole["fallbacks"]
    assert max(whole["fallbacks"]) > 0


def test_without_a_process_group_the_numbers_are_unchanged() -> None:
    layer, x, weights = _setup("lstm", "batch", "timestep")
    plain = _step(layer, x, torch.tensor(LENGTHS), weights)
    layer, x, weights = _setup("lstm", "batch", "timestep")
    converted = seqnorm.convert_sync_batchnorm(layer)
    assert converted is layer
    assert all(type(m) is SyncTimestepBatchNorm for m in layer.modules() if isinstance(m, TimestepBatchNorm))
    synced = _step(layer, x, torch.tensor(LENGTHS), weights)
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert_close(synced[key], value, rtol=1e-12, atol=1e-12, msg=key)
    state = layer.state_dict()
    assert set(state) == set(LAYERS["lstm"](3, 4, num_layers=2, norm="batch").state_dict())


def test_a_foreign_subclass_is_refused() -> None:
    class Custom(TimestepBatchNorm):
        pass

    module = torch.nn.Sequential(Custom(3))
    with pytest.raises(
        ValueError, match=r"^convert_sync_batchnorm: expected seqnorm's own batch norms .* got a subclass"
    ):
        seqnorm.convert_sync_batchnorm(module)


def _diagnostic_on_rank_zero(rank: int, folder: str) -> None:
    # HiddenStateStats' train/eval gap runs a training-mode forward on rank 0 alone: without local_statistics its
    # collectives would wait for rank 1 (and the test would hang).
    from seqnorm.norms.sync import local_statistics

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        layer, x, _ = _setup("lstm", "batch", "timestep")
        seqnorm.convert_sync_batchnorm(layer)
        if rank == 0:
            with local_statistics(layer):
                local, _ = layer(x)
            alone, _ = _setup("lstm", "batch", "timestep")[0](x)
            torch.save((local.detach(), alone.detach()), f"{folder}/local.pt")
        layer(x[:, rank::2])[0].sum().backward()  # and synchronization is back afterwards: both take part
        dist.barrier()  # neither process tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()


def test_local_statistics_lets_one_process_run_alone(tmp_path: Path) -> None:
    mp.spawn(_diagnostic_on_rank_zero, args=(str(tmp_path),), nprocs=2, join=True)
    local, alone = torch.load(tmp_path / "local.pt")
    assert_close(local, alone, rtol=1e-12, atol=1e-12)  # this process's own statistics, as an unconverted layer


def _offset_input() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return seqnorm.LSTM(3, 8, norm="batch"), 1000 + torch.randn(4, 8, 3)


def _offset_rank(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        layer, x = _offset_input()
        seqnorm.convert_sync_batchnorm(layer)
        rows = slice(0, 3) if rank == 0 else slice(3, 8)  # unequal shares
        torch.save(layer(x[:, rows])[0].detach(), f"{folder}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_synchronized_float32_is_as_accurate_as_one_process_for_inputs_with_a_large_mean(tmp_path: Path) -> None:
    """Inputs 1000 + N(0, 1) in float32, fresh running means (0): E[(x - m)²] - E[x - m]² cancelled the variance
    (outputs 0.1 off); merged per-process moments are as accurate as one process on all rows."""
    mp.spawn(_offset_rank, args=(str(tmp_path),), nprocs=2, join=True)
    synced = torch.cat([torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)], dim=1)
    layer, x = _offset_input()
    single = layer(x)[0].detach()
    exact = layer.double()(x.double())[0]  # the same rows, float64
    assert (single.double() - exact).abs().max() < 1e-4  # what float32 gives in one process
    assert (synced.double() - exact).abs().max() < 1e-4
