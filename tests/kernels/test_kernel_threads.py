"""The compiled kernels under threads and fork: the recurrences run without the GIL (two Python threads training
their own models give what the same runs give one after the other), the process-wide settings stand being set from
several threads while kernels run, and a fork while another thread holds a kernel lock leaves the child working."""

from __future__ import annotations

import copy
import functools
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from seqnorm import kernels
from seqnorm.kernels import cpu
from tests.conftest import LAYERS, TORCH_KINDS, require_kernels

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _settings_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The kernels loaded; the product route, the kept-memory limit and torch's thread count as they were after."""
    require_kernels()
    native = kernels.native("cpu")
    limit, threads = native.cache_info()[1], torch.get_num_threads()
    monkeypatch.setattr(cpu, "_CACHE_LIMIT", [None])
    yield native
    native.set_product_route("auto")
    native.set_cache_limit(limit)
    torch.set_num_threads(threads)


def _in_threads(*jobs: Callable[[], Any]) -> list[Any]:
    """Each job in its own thread, all at once; their results, or the first exception raised in any."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(index: int, job: Callable[[], Any]) -> None:
        try:
            results[index] = job()
        except BaseException as error:  # raised again in the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index, job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _train(layer: Any, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """A few SGD steps through the kernels (forward and backward) on one thread; the losses and the parameters."""
    torch.set_num_threads(1)  # per thread: torch's intra-op thread count is the calling thread's
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for x in batches:
        output, _ = layer(x)
        loss = output.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return [*losses, *(parameter.detach().clone() for parameter in layer.parameters())]


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_two_threads_training_their_own_models_give_what_the_runs_give_one_after_the_other(kind: str) -> None:
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # one product route, the same in every run
    try:
        torch.manual_seed(0)
        models = [LAYERS[kind](8, 64, norm="layer") for _ in range(2)]
        data = [[torch.randn(40, 16, 8) for _ in range(3)] for _ in models]
        alone = [_train(copy.deepcopy(model), batches) for model, batches in zip(models, data, strict=True)]
        together = _in_threads(*(functools.partial(_train, m, b) for m, b in zip(models, data, strict=True)))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for got, expected in zip(together, alone, strict=True):
        for tensor, want in zip(got, expected, strict=True):
            assert torch.equal(tensor, want)


def test_the_settings_stand_being_set_from_threads_while_kernels_run(_settings_restored: Any) -> None:
    """Two threads train on new shapes (their product routes still on trial) while two others set and read the route
    setting, the kept-memory limit and what was chosen: nothing fails and every result is the forced route's up to
    rounding."""
    native = _settings_restored
    torch.manual_seed(1)
    layer = LAYERS["lstm"](8, 40, norm="layer")  # 160 columns: shapes no other test has tried
    batches = [torch.randn(30, rows, 8) for rows in (8, 9, 10, 11, 12, 13)]
    native.set_product_route("blas")
    expected = [layer(x)[0].detach() for x in batches]
    native.set_product_route("auto")
    done = threading.Event()

    def train(order: list[int]) -> list[tuple[int, torch.Tensor]]:
        torch.set_num_threads(1)
        twin = copy.deepcopy(layer)
        results = []
        for index in order:
            output, _ = twin(batches[index])
            output.sum().backward()
            results.append((index, output.detach()))
        return results

    def set_and_read(seed: int) -> int:
        chooser = random.Random(seed)
        rounds = 0
        while not done.is_set() or rounds < 50:
            native.set_product_route(chooser.choice(["auto", "brgemm", "packed", "blas"]))
            assert native.product_candidates(chooser.choice([1, 8, 16]))
            native.chosen_routes()
            kernels.set_cache_limit(chooser.choice([0, 1, 4, 64]))
            kernels.cache_info()
            if chooser.random() < 0.2:
                kernels.empty_cache()
            rounds += 1
        return rounds

    def trainers() -> list[list[tuple[int, torch.Tensor]]]:
        try:
            return _in_threads(lambda: train([0, 1, 2, 3, 4, 5] * 2), lambda: train([5, 4, 3, 2, 1, 0] * 2))
        finally:
            done.set()

    trained, *_ = _in_threads(trainers, lambda: set_and_read(0), lambda: set_and_read(1))
    for results in trained:
        for index, output in results:
            torch.testing.assert_close(output, expected[index], rtol=1e-4, atol=1e-5)


# A thread holds one of the kernels' process-wide locks while the main thread forks; the child then runs a training
# step through the kernels. Without a fork handler the child inherits the lock held, by a thread it does not have,
# and its first kernel call waits forever: the parent kills it after a while and says so.
_FORK_WHILE_LOCKED = """
import os, signal, sys, threading, time
import torch, seqnorm
from seqnorm import kernels
name = sys.argv[1]
native = kernels.native("cpu")
layer = seqnorm.LSTM(8, 64, norm="layer")
x = torch.randn(64, 32, 8)  # saved blocks of 2-8 MiB: from the kept memory
if name == "routes" and len(native.product_candidates(32)) < 2:
    print("one route: no trial")
    sys.exit(0)
holder = threading.Thread(target=native._hold_lock, args=(name, 1.0))
holder.start()
while not native._lock_held(name):
    time.sleep(0.001)
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # the child's OpenMP pool is not the parent's: one thread, as DataLoader workers do
    output, _ = layer(x)
    output.sum().backward()
    os._exit(0)
holder.join()
for _ in range(600):
    finished, status = os.waitpid(pid, os.WNOHANG)
    if finished:
        print("child exit", os.waitstatus_to_exitcode(status))
        sys.exit(0)
    time.sleep(0.05)
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print("child deadlocked")
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
@pytest.mark.parametrize("lock", ["cache", "routes"])
def test_a_fork_while_another_thread_holds_a_kernel_lock_leaves_the_child_working(lock: str) -> None:
    done = subprocess.run([sys.executable, "-c", _FORK_WHILE_LOCKED, lock], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("child exit 0", "one route: no trial"), done.stdout + done.stderr
