"""The check of the gradient at a layer's input, deferred as on a GPU: exercised on CPU tensors by declaring them
deferred, with markers standing in for the device's events."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import seqnorm
from seqnorm.layers import finite

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}
MESSAGE = r"^LSTM: expected a finite gradient at the input, got inf/NaN after backpropagating through 6 steps"
LATE = "found by the device-side check of an earlier backward"


class CountHostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


class Pending:
    """An event the device has not reached yet; it completes when waited for."""

    def __init__(self) -> None:
        self.completed = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.completed = True


@pytest.fixture(autouse=True)
def empty_queue() -> Iterator[None]:
    finite._pending.clear()
    yield
    finite._pending.clear()


@pytest.fixture
def deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finite, "_deferred", lambda tensor: True)


@pytest.fixture
def unfinished(deferred: None, monkeypatch: pytest.MonkeyPatch) -> list[Pending]:
    """The markers handed out, each pending until synchronized."""
    markers: list[Pending] = []

    def to_host(flag: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        markers.append(Pending())
        return flag, markers[-1]

    monkeypatch.setattr(finite, "_to_host", to_host)
    return markers


def infinite_backward(layer: torch.nn.Module, x: torch.Tensor) -> None:
    (layer(x)[0] * torch.tensor(float("inf"))).sum().backward()


def messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught]


def test_the_immediate_check_reads_the_host_and_warns_in_backward() -> None:
    """The CPU's check, and the control for the counter below."""
    layer = seqnorm.LSTM(3, 4, norm="layer")
    x = torch.randn(6, 2, 3, requires_grad=True)
    output, _ = layer(x)
    with CountHostReads() as reads, pytest.warns(RuntimeWarning, match=MESSAGE):
        (output * torch.tensor(float("inf"))).sum().backward()
    assert reads.count > 0 and not finite._pending


def test_the_deferred_check_reads_nothing_on_the_host_and_warns_at_the_next_forward(deferred: None) -> None:
    layer = seqnorm.LSTM(3, 4, norm="layer")
    x = torch.randn(6, 2, 3, requires_grad=True)
    output, _ = layer(x)
    with CountHostReads() as reads, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in backward
        (output * torch.tensor(float("inf"))).sum().backward()
    assert reads.count == 0 and len(finite._pending) == 1
    with pytest.warns(RuntimeWarning, match=MESSAGE) as caught:
        layer(x)
    assert len(caught) == 1 and str(caught[0].message).endswith(f"or use norm='layer' [reported late: {LATE}]")
    assert not finite._pending  # the new forward's check waits for its backward


def test_flush_waits_for_the_pending_checks_only_when_asked(unfinished: list[Pending]) -> None:
    layer = seqnorm.LSTM(3, 4, norm="batch")
    x = torch.randn(6, 2, 3, requires_grad=True)
    infinite_backward(layer, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        finite.flush_pending_checks()
        layer(x)  # the device has not answered: polled, not waited for
    assert len(finite._pending) == 1 and not unfinished[0].completed
    with pytest.warns(RuntimeWarning, match=rf"{MESSAGE} \(per-timestep batch statistics") as caught:
        finite.flush_pending_checks(block=True)
    assert len(caught) == 1 and LATE in str(caught[0].message)
    assert not finite._pending and unfinished[0].completed


def test_a_finite_gradient_is_not_reported_even_where_its_sum_overflows(deferred: None) -> None:
    x = torch.zeros(2, 1, 1, requires_grad=True)
    watched = finite.watch_input_gradient("Probe", x, 2, batch_statistics=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watched.backward(torch.full_like(x, 3e38))
        finite.flush_pending_checks(block=True)
    assert torch.isinf(x.grad.sum()) and not finite._pending
    watched = finite.watch_input_gradient("Probe", x, 2, batch_statistics=False)
    watched.backward(torch.tensor([[[1.0]], [[float("nan")]]]))
    with pytest.warns(RuntimeWarning, match=r"^Probe: expected a finite gradient at the input, got .* through 2 steps"):
        finite.flush_pending_checks(block=True)


def test_the_queue_is_bounded_and_a_full_one_reports_its_oldest(
    unfinished: list[Pending], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finite, "MAX_PENDING", 2)
    x = torch.zeros(2, 1, 1, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for steps in range(1, 6):
            finite.watch_input_gradient(f"Probe{steps}", x, steps, False).backward(torch.full_like(x, float("inf")))
            assert len(finite._pending) <= 2
    assert [message.split(":")[0] for message in messages(caught)] == ["Probe1", "Probe2", "Probe3"]
    assert [marker.completed for marker in unfinished] == [True, True, True, False, False]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finite.flush_pending_checks(block=True)
    assert [message.split(":")[0] for message in messages(caught)] == ["Probe4", "Probe5"]
