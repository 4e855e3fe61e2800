"""Differential fuzz: random layer configurations, each run three ways, which must agree.

1. the layer as users get it (``impl="auto"``: the compiled kernels where the plan routes there);
2. the same layer with the kernels switched off (:func:`seqnorm.kernels.disabled`: the plain fast paths);
3. a float64 copy with ``impl="reference"`` (the cell's own step at every step).

Compared: outputs, final states, the gradients of the input and of every parameter, and every buffer afterwards
(batch norms' running statistics and counts). The cases come from a seeded ``random.Random`` per case, so a case
id (``case07-...``) reruns alone: ``pytest tests/test_fuzz.py -k case07``. The budget is :data:`CASES` small
layers (T <= 7, B <= 5, H <= 9), a few seconds in all.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import seqnorm
from seqnorm import kernels
from tests.conftest import LAYERS, perturb_norm_parameters, with_spec

SEED = 29
CASES = 36  # six per registered norm: about 6 s of CPU on this machine
NORMS = list(seqnorm.NORMS)
# Float64 paths differ only in the order of additions; float32 against the float64 reference is scaled by the
# largest reference value (BN divides by sqrt(var + eps), which amplifies float32 rounding of near-constant rows).
TIGHT = {"rtol": 1e-9, "atol": 1e-9}
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
# warmup 0 and one-batch ramps: batch renorm's r/d correction acts from the first training batch on
RENORM_ACTIVE = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1, "r_max": 1.5, "d_max": 0.5}


@dataclass(frozen=True)
class Case:
    kind: str
    norm: str
    steps: int
    batch: int
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    lengths: tuple[int, ...] | None
    dtype: torch.dtype
    threads: int
    training: bool

    @property
    def id(self) -> str:
        lengths = "full" if self.lengths is None else "-".join(map(str, self.lengths))
        return (
            f"{self.kind}-{self.norm}-T{self.steps}B{self.batch}I{self.input_size}H{self.hidden_size}"
            f"L{self.num_layers}{'bi' if self.bidirectional else ''}-len{lengths}-{str(self.dtype)[6:]}"
            f"-th{self.threads}-{'train' if self.training else 'eval'}"
        )

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_layers": self.num_layers, "bidirectional": self.bidirectional}
        if self.norm == "batch_renorm":
            options["norm_options"] = RENORM_ACTIVE
        if seqnorm.NORMS[self.norm].batch_statistics and self.batch == 1:
            options["small_batch"] = "running"  # the one policy under which a batch of one row trains
        return with_spec(self.norm, **options)


def _case(index: int) -> Case:
    rng = random.Random(SEED * 1000 + index)
    steps, batch = rng.randint(1, 7), rng.choice([1, 2, 3, 5])
    lengths = None
    if rng.random() < 0.6:
        lengths = tuple(steps if rng.random() < 0.3 else rng.randint(1, steps) for _ in range(batch))
        if rng.random() < 0.5:  # the longest row need not fill the input (then the last steps are all padding)
            lengths = (steps, *lengths[1:])
    return Case(
        kind=rng.choice(list(LAYERS)),
        norm=NORMS[index % len(NORMS)],  # every norm as often as the others
        steps=steps,
        batch=batch,
        input_size=rng.choice([1, 2, 3, 5, 8]),
        hidden_size=rng.choice([1, 2, 3, 5, 7, 9]),
        num_layers=rng.randint(1, 2),
        bidirectional=rng.random() < 0.5,
        lengths=lengths,
        dtype=rng.choice([torch.float32, torch.float64]),
        threads=rng.choice([1, 2]),
        training=rng.random() < 0.6,
    )


CASE_LIST = [_case(index) for index in range(CASES)]


def _layer(case: Case, dtype: torch.dtype, impl: str = "auto") -> Any:
    return LAYERS[case.kind](case.input_size, case.hidden_size, impl=impl, dtype=dtype, **case.options()).train(
        case.training
    )


def _run(layer: Any, case: Case, x: torch.Tensor, weights: list[torch.Tensor], plain: bool) -> dict[str, Any]:
    """Output, final state, gradients (input and parameters, by name) and buffers after one forward/backward."""
    dtype = next(layer.parameters()).dtype
    leaf = x.to(dtype).requires_grad_()
    lengths = None if case.lengths is None else torch.tensor(case.lengths)
    with kernels.disabled() if plain else nullcontext():
        path = layer.plan(leaf).path
        output, state = layer(leaf, lengths=lengths)
        states = state if isinstance(state, tuple) else (state,)
        results = (output, *states)
        loss = sum((result * weight.to(dtype)).sum() for result, weight in zip(results, weights, strict=True))
        names, parameters = zip(*layer.named_parameters(), strict=True)
        gradients = torch.autograd.grad(loss, [leaf, *parameters], allow_unused=True)
    return {
        "path": path,
        "results": results,
        "grad_input": gradients[0],
        "grad": {name: grad for name, grad in zip(names, gradients[1:], strict=True) if grad is not None},
        "buffers": {name: buffer.clone() for name, buffer in layer.named_buffers()},
    }


def _compare(got: dict[str, Any], expected: dict[str, Any], tolerance: dict[str, float], what: str) -> None:
    for key in ("results", "grad_input", "grad", "buffers"):
        have, want, within = got[key], expected[key], tolerance
        if tolerance is FLOAT32:  # compared in float64, atol scaled by the reference's largest value
            have, want = _to64(have), _to64(want)
            scale = max([1.0] + [float(t.detach().abs().max()) for t in _tensors(want) if t.numel()])
            within = {"rtol": FLOAT32["rtol"], "atol": FLOAT32["atol"] * scale}
        assert_close(have, want, **within, msg=lambda message, key=key: f"{what}, {key}: {message}")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [tensor for item in items for tensor in _tensors(item)]


def _to64(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _to64(item) for key, item in value.items()}
    return tuple(_to64(item) for item in value)


@pytest.mark.parametrize("case", CASE_LIST, ids=[f"case{index:02d}-{case.id}" for index, case in enumerate(CASE_LIST)])
def test_paths_agree(case: Case) -> None:
    torch.manual_seed(SEED)
    layer = _layer(case, case.dtype)
    perturb_norm_parameters(layer)  # gains, shifts and running statistics away from their initial values
    with torch.no_grad():
        for name, buffer in layer.named_buffers():
            if name.endswith("num_batches_tracked"):  # some steps seen: the running average's weight is not 1
                buffer.copy_(torch.randint(0, 4, buffer.shape))
    reference = _layer(case, torch.float64, impl="reference")
    reference.load_state_dict(layer.state_dict())
    state = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    x = torch.randn(case.steps, case.batch, case.input_size, dtype=torch.float64)
    states = 2 if case.kind == "lstm" else 1
    directions = 2 if case.bidirectional else 1
    shapes = [(case.steps, case.batch, directions * case.hidden_size)]
    shapes += [(case.num_layers * directions, case.batch, case.hidden_size)] * states
    weights = [torch.randn(shape, dtype=torch.float64) for shape in shapes]

    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        expected = _run(reference, case, x, weights, plain=True)
        plain = _run(layer, case, x, weights, plain=True)
        tolerance = TIGHT if case.dtype == torch.float64 else FLOAT32
        _compare(plain, expected, tolerance, f"plain path ({plain['path']}) against the float64 reference")
        if kernels.native("cpu") is None:
            pytest.skip(f"kernels unavailable ({kernels.status()}): plain path compared with the reference only")
        layer.load_state_dict(state)  # the plain run updated the running statistics
        compiled = _run(layer, case, x, weights, plain=False)
        path = compiled["path"]
        _compare(compiled, expected, tolerance, f"default path ({path}) against the float64 reference")
        _compare(compiled, plain, tolerance, f"default path ({path}) against the plain path ({plain['path']})")
    finally:
        torch.set_num_threads(threads)
