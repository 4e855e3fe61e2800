"""The Triton backend (seqnorm.kernels.triton_backend), run on CPU tensors through Triton's interpreter.

``SEQNORM_BACKEND=triton`` with ``TRITON_INTERPRET=1`` routes the layers' CPU tensors through the Triton backend, so
the real plan, autograd Function and generation step run, with the same kernels a GPU compiles. Compared with the
plain-PyTorch path (kernels off): outputs, states, gradients of the input and of every parameter; lengths, B=1,
sizes that are not multiples of the block, two layers, bidirectional; float32 and float64; gradcheck in float64.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import inspect
import os
import re
import tokenize
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import seqnorm
from seqnorm import kernels
from seqnorm.layers.plan import norm_blocker, plan_for
from tests.conftest import perturb_norm_parameters, with_spec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# The norms whose modules declare the kernels' form (the rest take torch's fused kernel or the plain path).
KERNEL_NORMS = [
    name for name in seqnorm.NORMS if (norm := seqnorm.LSTMCell(2, 3, norm=name).norm_hh) is not None
    and norm_blocker(norm, "kernel") is None
]  # fmt: skip


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The Triton backend for CPU tensors, through the interpreter, for each test (the C++ backend after it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the first import
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    monkeypatch.setattr(kernels, "_LOADED", {})
    backend = kernels.native("cpu")
    assert backend is not None and backend.name == "triton", kernels.status("cpu")
    yield backend


def _loss(output: torch.Tensor, state: Any, weights: list[torch.Tensor]) -> torch.Tensor:
    states = state if isinstance(state, tuple) else (state,)
    return sum(((t * w).sum() for t, w in zip((output, *states), weights, strict=True)), torch.zeros(()))


def _run(layer: Any, x: torch.Tensor, lengths: torch.Tensor | None, weights: list[torch.Tensor]) -> list[Any]:
    """Outputs, states, the gradients of the input and of every parameter, every buffer (BN's running statistics)
    and the norms' fallback steps, after one forward and backward of a copy of ``layer``."""
    layer = copy.deepcopy(layer)
    x = x.detach().requires_grad_()
    output, state = layer(x, lengths=lengths)
    _loss(output, state, weights).backward()
    states = list(state) if isinstance(state, tuple) else [state]
    fallbacks = [getattr(module, "fallback_steps", 0) for module in layer.modules()]
    return [output.detach(), *(s.detach() for s in states), x.grad, *(p.grad for p in layer.parameters()),
            *layer.buffers(), torch.tensor(fallbacks)]  # fmt: skip


def _options(norm: str, batch: int) -> dict[str, Any]:
    """Per-timestep BN's small-batch fallback on (padded tails with one real row, batch 1); batch renorm's r/d
    correction acting from the first batch."""
    if not seqnorm.NORMS[norm].batch_statistics:
        return {"norm": norm}
    options: dict[str, Any] = {"small_batch": "running"}
    if norm == "batch_renorm":
        options["norm_options"] = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1, "r_max": 1.5, "d_max": 0.5}
    return with_spec(norm, **options)


CASES = {  # (T, B, input, hidden, layers, bidirectional, lengths)
    "two-layers-bidirectional-lengths": (4, 3, 3, 5, 2, True, [4, 2, 3]),
    "batch-1": (3, 1, 2, 3, 1, False, None),
    "odd-sizes": (3, 5, 7, 9, 1, False, [3, 3, 1, 2, 3]),
}


# float32 where the problem is well conditioned: two layers of BN over 2-3 rows amplify rounding so much that the
# plain float32 path itself is 5e-5 (outputs) and 9e-5 (gradients) off float64 there; float64 everywhere.
PRECISIONS = [
    pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}")
    for case in CASES
    for dtype in (torch.float64, torch.float32)
    if dtype == torch.float64 or CASES[case][4] == 1
]


@pytest.mark.parametrize(("case", "dtype"), PRECISIONS)
@pytest.mark.parametrize("norm", KERNEL_NORMS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_backend_matches_the_plain_path(kind: str, norm: str, case: str, dtype: torch.dtype) -> None:
    steps, batch, inputs, hidden, layers, bidirectional, lengths = CASES[case]
    torch.manual_seed(len(case) + layers)
    layer = seqnorm.LAYERS[kind](
        inputs, hidden, num_layers=layers, bidirectional=bidirectional, **_options(norm, batch)
    ).to(dtype)
    perturb_norm_parameters(layer)
    x = torch.randn(steps, batch, inputs, dtype=dtype)
    lengths_t = None if lengths is None else torch.tensor(lengths)
    assert layer.plan(x.requires_grad_(), lengths=lengths_t).path == "triton"
    with torch.no_grad():
        probe_out, probe_state = copy.deepcopy(layer)(x, lengths=lengths_t)
    states = probe_state if isinstance(probe_state, tuple) else (probe_state,)
    weights = [torch.randn_like(t) for t in (probe_out, *states)]
    fast = _run(layer, x, lengths_t, weights)
    with kernels.disabled():
        plain = _run(layer, x, lengths_t, weights)
    # float32: outputs and states within 1e-5 of the tensor's scale; gradients, sums over every step and row that
    # each path orders differently, within 1e-4 (the plain float32 path itself is up to 3e-5 off float64's there)
    compared_states = 1 + len(states)
    for index, (got, expected) in enumerate(zip(fast, plain, strict=True)):
        if not expected.is_floating_point():  # counts: num_batches_tracked, the fallback steps
            assert torch.equal(got, expected)
            continue
        tolerance = 1e-10 if dtype == torch.float64 else (1e-5 if index < compared_states else 1e-4)
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("norm", ["none", "weight"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_backend_without_recurrent_norms_over_more_steps_than_rows(kind: str, norm: str) -> None:
    """The loops handed a norm that keeps no statistics the row of a (B, H) scratch at each step: an IndexError
    from the third step at batch 2, wherever a gradient was wanted (the plan takes this path when torch's fused
    kernel is declined: input dropout, autocast)."""
    torch.manual_seed(3)
    layer = seqnorm.LAYERS[kind](2, 3, norm=norm, impl="triton", dtype=torch.float64)
    x = torch.randn(5, 2, 2, dtype=torch.float64)
    output, state = layer(x)
    weights = [torch.randn_like(t) for t in (output, *(state if isinstance(state, tuple) else (state,)))]
    reference = seqnorm.LAYERS[kind](2, 3, norm=norm, impl="reference", dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    torch.testing.assert_close(_run(layer, x, None, weights), _run(reference, x, None, weights), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", ["batch", "batch_renorm"])
def test_a_batch_norm_step_outside_the_recurrence_runs_on_the_triton_backend(norm: str) -> None:
    """A training step of per-timestep BN outside the kernels' recurrence (the reference loop, the loop path, a cell
    in one's own loop) asked the CPU's backend for the C++ kernels' norm_step: with Triton's interpreter as the
    CPU's backend, an AttributeError."""
    cell = seqnorm.LSTMCell(2, 3, norm=norm)
    x, state = torch.randn(4, 2), (torch.zeros(4, 3), torch.zeros(4, 3))
    expected = copy.deepcopy(cell)
    h, _ = cell(x, state, step=0)
    with kernels.disabled():
        torch.testing.assert_close(h, expected(x, state, step=0)[0])
    torch.testing.assert_close(cell.norm_hh.running_var, expected.norm_hh.running_var)


@pytest.mark.parametrize("norm", KERNEL_NORMS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_backend_gradcheck(kind: str, norm: str) -> None:
    torch.manual_seed(0)
    layer = seqnorm.LAYERS[kind](2, 3, norm=norm).double()
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([3, 2])
    assert layer.plan(x, lengths=lengths).path == "triton"
    hx = (h0, torch.randn(1, 2, 3, dtype=torch.float64)) if kind == "lstm" else h0

    def run(x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        state = (h0, hx[1]) if kind == "lstm" else h0
        return layer(x, state, lengths=lengths)[0]

    assert torch.autograd.gradcheck(run, (x, h0), fast_mode=True)


@pytest.mark.parametrize("norm", KERNEL_NORMS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_generation_step_matches_the_plain_step(kind: str, norm: str) -> None:
    torch.manual_seed(1)
    layer = seqnorm.LAYERS[kind](3, 5, norm=norm).double().eval()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        assert plan_for(layer, x[0], step=True).cells == ("triton",)
        fast_state = plain_state = None
        for x_t in x.unbind(0):
            fast, fast_state = layer.step(x_t, fast_state)
            with kernels.disabled():
                plain, plain_state = layer.step(x_t, plain_state)
            torch.testing.assert_close(fast, plain, rtol=1e-10, atol=1e-10)


def test_what_the_backend_does_not_run_takes_the_plain_path(triton_backend: Any) -> None:
    mixed = ("none", "layer", "batch")  # a recurrent norm per row beside a cell-state norm across the rows
    assert "statistics per row and across the rows mixed" in triton_backend.unsupported(mixed, torch.float32)
    assert triton_backend.unsupported(("layer",) * 3, torch.float16) == "dtype torch.float16"
    assert "in training" in triton_backend.unsupported(("batch",) * 3, torch.float32, step=True, training=True)
    layer = seqnorm.LSTM(3, 4, norm="batch")
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert plan_for(layer, x, step=True).cells != ("triton",)  # training: batch statistics of one step
        assert plan_for(layer.eval(), x, step=True).cells == ("triton",)  # evaluation: folded, it runs


# --- launches and host synchronizations per step ---

_NOT_LAUNCHES = {  # aten ops that launch nothing on a GPU: views, allocation, metadata
    "t", "view", "_unsafe_view", "reshape", "select", "slice", "unsqueeze", "squeeze", "as_strided", "detach",
    "alias", "empty", "new_empty", "empty_like", "expand", "permute", "transpose", "unbind", "split",
    "lift_fresh", "_to_copy", "_local_scalar_dense", "is_nonzero", "item", "contiguous",
}  # fmt: skip
_SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero"}
_VIEWS = {  # aten ops whose result shares its input's memory: no allocation
    "t", "view", "_unsafe_view", "reshape", "select", "slice", "unsqueeze", "squeeze", "as_strided", "detach",
    "alias", "expand", "permute", "transpose", "unbind", "split", "lift_fresh",
}  # fmt: skip


class _Ops(TorchDispatchMode):
    """The aten ops a region runs, by name, and how many of them allocated device memory for their result (every op
    but a view, an in-place op and an ``out=`` variant; ``contiguous`` of a contiguous tensor returns it as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.allocations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.names.append(name)
        result = func(*args, **(kwargs or {}))
        if name not in _VIEWS and not name.endswith("_") and func._overloadname != "out" and name not in _SYNCS:
            inputs = [arg for arg in args if isinstance(arg, torch.Tensor)]
            if not (isinstance(result, torch.Tensor) and any(result is arg for arg in inputs)):
                self.allocations += 1
        return result


def _launches(
    backend: Any, norm: str, steps: int, monkeypatch: pytest.MonkeyPatch, autocast: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) counts of Triton launches, other launching aten ops and host syncs of one LSTM (the
    forward under bf16 autocast where ``autocast``)."""
    from seqnorm.kernels.triton_backend import columns, norms, recurrence

    triton_launches = [0]
    for module in (recurrence, columns, norms):
        for name, kernel in inspect.getmembers(module):
            if hasattr(kernel, "run") and hasattr(kernel, "fn") and not name.startswith("_"):
                real = kernel.run

                def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                    triton_launches[0] += 1
                    with _disable_current_modes():  # the interpreter's own copies are not the program's launches
                        return _real(*args, **kwargs)

                monkeypatch.setattr(kernel, "run", counted)
    layer = seqnorm.LSTM(4, 6, norm=norm)
    x = torch.randn(steps, 3, 4, requires_grad=True)
    lengths = torch.tensor([steps, steps - 1, 2])
    counts = []
    for phase in ("forward", "backward"):
        triton_launches[0] = 0
        with _Ops() as ops:
            if phase == "forward":
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    output, _ = layer(x, lengths=lengths)
            else:
                output.sum().backward()
        aten = [name for name in ops.names if name not in _NOT_LAUNCHES]
        syncs = [name for name in ops.names if name in _SYNCS]
        counts.append({"launches": triton_launches[0] + len(aten), "syncs": len(syncs), "allocations": ops.allocations})
    monkeypatch.undo()
    return counts[0], counts[1]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("norm", ["layer", "batch"])  # the two layouts: a program per row, per block of features
def test_at_most_two_launches_a_step_and_no_sync_or_allocation_in_the_loop(
    triton_backend: Any, monkeypatch: pytest.MonkeyPatch, norm: str, autocast: bool
) -> None:
    """Per time step, forward and backward: at most two launches (the product and the step kernel), and no host
    sync or allocation (what a CUDA graph over the loop needs): the counts at 3 and 7 steps, whose difference is
    the loop's. Under autocast the half-precision product on CPU tensors is a copy that widens its left operand and
    a product (:class:`StepProduct`'s exact emulation; on a GPU one cuBLAS call): three launches there."""
    short = _launches(triton_backend, norm, 3, monkeypatch, autocast)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    monkeypatch.setattr(kernels, "_LOADED", {"cpu": triton_backend})
    long = _launches(triton_backend, norm, 7, monkeypatch, autocast)
    for phase, before, after in (("forward", short[0], long[0]), ("backward", short[1], long[1])):
        per_step = (after["launches"] - before["launches"]) / 4
        assert per_step <= (3 if autocast else 2), f"{phase}: {per_step} launches a step"
        assert after["syncs"] == before["syncs"], f"{phase}: a host sync inside the loop"
        assert after["allocations"] == before["allocations"], f"{phase}: an allocation inside the loop"


# Builds each recorded launch to Triton's IR for a Hopper GPU (sm_90) in a process without the interpreter: the
# frontend's type checks, which the interpreter does not make, run on any machine.
_BUILD = """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton._C.libtriton import ir

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
context = ir.context()
ir.load_dialects(context)
backend.load_dialects(context)
failures = []
for module, name, signature, constants in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    try:
        ASTSource(kernel, signature, constants).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
        )
    except Exception as error:
        failures.append(f"{name} {constants}: {str(error)[-400:]}")
print("\\n\\n".join(failures))
sys.exit(1 if failures else 0)
"""

_POINTERS = {
    torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.int64: "i64", torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8", torch.int8: "i8",
}  # fmt: skip


def _argument_type(value: Any) -> str:
    """Triton's name for the type of a launch argument."""
    if isinstance(value, torch.Tensor):
        return "*" + _POINTERS[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a launch argument of type {type(value).__name__}")


@contextmanager
def _recorded_launches() -> Iterator[dict[tuple[Any, ...], list[Any]]]:
    """Every distinct kernel specialization launched inside: module, name, argument types, compile-time constants.
    The kernels are not run (what a layer launches depends on shapes and flags, not on the values its kernels write:
    the same 128 specializations as with the kernels run, when this was written), so their outputs are garbage."""
    from triton.runtime import interpreter

    launches: dict[tuple[Any, ...], list[Any]] = {}

    def recording(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        parameters = inspect.signature(self.fn).parameters
        bound = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        signature, constants = {}, {}
        for name, parameter in parameters.items():
            value = bound.get(name, parameter.default)
            if value is None or "constexpr" in str(parameter.annotation):
                signature[name], constants[name] = "constexpr", value
            else:
                signature[name] = _argument_type(value)
        record = [self.fn.__module__, self.fn.__name__, signature, constants]
        launches[repr(record)] = record

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the garbage's non-finite gradients)
        patch.setattr(interpreter.InterpretedFunction, "run", recording)
        yield launches


def test_every_kernel_launch_builds_for_a_gpu() -> None:
    """The interpreter runs what a GPU build refuses: an H200 refused the BN column kernels for a helper whose two
    returns differed in type (int64 and int32), which every interpreted test had run. Each specialization that
    training (lengths or none), evaluation, generation and autocast launch, for every kernel norm, cell and dtype, is
    built to Triton's IR for an sm_90 target in a process without the interpreter."""
    import json
    import subprocess
    import sys

    with _recorded_launches() as launches:
        for kind in ("lstm", "gru"):
            for norm in KERNEL_NORMS:
                for dtype in (torch.float32, torch.float64):
                    layer = seqnorm.LAYERS[kind](2, 3, **_options(norm, 2)).to(dtype)
                    for lengths in (torch.tensor([2, 1]), None):
                        output, _ = layer(torch.randn(2, 2, 2, dtype=dtype, requires_grad=True), lengths=lengths)
                        output.sum().backward()
                    # float32's step products in either half precision (autocast leaves float64 as it is: its
                    # launches are the training ones above)
                    for half in (torch.bfloat16, torch.float16) if dtype == torch.float32 else ():
                        with torch.autocast("cpu", dtype=half):
                            output, _ = layer(torch.randn(2, 2, 2, dtype=dtype, requires_grad=True))
                        output.float().sum().backward()
                    with torch.no_grad():
                        layer.eval()(torch.randn(2, 2, 2, dtype=dtype))
                        layer.step(torch.randn(1, 2, dtype=dtype))
    assert {record[1] for record in launches.values()} >= {"lstm_columns", "gru_columns"}, "no BN kernel ran"
    halves = {record[2].get(name) for record in launches.values() for name in ("h_half_ptr", "d_half_ptr")}
    assert halves >= {"*bf16", "*fp16"}, halves
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _BUILD], input=json.dumps(list(launches.values())), env=environment,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{len(launches)} launches built; failed:\n{result.stdout}{result.stderr[-2000:]}"


def test_kernels_use_only_what_compiles_on_a_gpu() -> None:
    """Constructs the interpreter accepts and a GPU build does not (or that the interpreter runs wrongly)."""
    folder = os.path.dirname(importlib.util.find_spec("seqnorm.kernels.triton_backend").origin)  # type: ignore[union-attr,arg-type]
    forbidden = re.compile(r"libdevice|inline_asm|make_block_ptr|atomic_xchg|tl\.math\.|tl\.dot|extra\.cuda")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as source:  # the code: no comments, no strings
                tokens = tokenize.generate_tokens(source.readline)
                code = " ".join(t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING))
            assert not forbidden.findall(code), f"{name}: {forbidden.findall(code)}"


def test_import_seqnorm_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = "import sys, seqnorm; seqnorm.LSTM(2, 3, norm='layer'); print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(kernels, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET=1"):
        assert kernels.native("cpu") is None
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda")
    monkeypatch.setattr(kernels, "_LOADED", {})
    with pytest.raises(ValueError, match="SEQNORM_BACKEND: expected auto or triton, got 'cuda'"):
        kernels.native("cpu")


def _autocast_run(layer: Any, x: torch.Tensor, autocast: bool, plain: bool) -> list[torch.Tensor]:
    layer = copy.deepcopy(layer)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), kernels.disabled() if plain else nullcontext():
        if autocast and not plain:
            assert layer.plan(x).path == "triton"
        output, _ = layer(x)
    output.sum().backward()
    return [output.detach(), x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("norm", KERNEL_NORMS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_under_autocast_the_backend_is_as_accurate_as_the_plain_path(kind: str, norm: str) -> None:
    """Under bf16 autocast the input projection runs in bf16 and the recurrence in float32 (statistics, gates,
    states): no further from float32 without autocast than the plain path under autocast is (which also runs W_hh h
    in bf16), and with the same dtypes."""
    torch.manual_seed(2)
    layer = seqnorm.LAYERS[kind](4, 6, **_options(norm, 3))
    x = torch.randn(5, 3, 4)
    reference = _autocast_run(layer, x, autocast=False, plain=True)
    fast = _autocast_run(layer, x, autocast=True, plain=False)
    plain = _autocast_run(layer, x, autocast=True, plain=True)

    def error(run: list[torch.Tensor]) -> float:
        return max(
            ((a - r).abs().max() / r.abs().max().clamp(min=1)).item() for a, r in zip(run, reference, strict=True)
        )

    assert [t.dtype for t in fast] == [t.dtype for t in plain]
    assert error(fast) <= 2 * error(plain) + 1e-3, (error(fast), error(plain))


def _rounded_products(monkeypatch: pytest.MonkeyPatch, half: torch.dtype) -> None:
    """The plain path's cells with ``h`` and ``W_hh`` rounded to ``half`` where they enter the recurrent product."""
    from seqnorm.cells.base import RecurrentCell

    recurrent_input, recurrent_weight = RecurrentCell.recurrent_input, RecurrentCell.recurrent_weight
    monkeypatch.setattr(RecurrentCell, "recurrent_input", lambda cell, h: recurrent_input(cell, h).to(half).to(h.dtype))
    monkeypatch.setattr(
        RecurrentCell, "recurrent_weight", lambda cell: (w := recurrent_weight(cell)).to(half).to(w.dtype)
    )


# Both layouts, both cells and both half precisions: RMS takes LN's kernels and batch renorm BN's, with another kind.
HALF_CASES = [
    pytest.param(kind, norm, half, id=f"{kind}-{norm}-{str(half)[6:]}")
    for kind, norm, half in [
        *((kind, norm, torch.bfloat16) for kind in ("lstm", "gru") for norm in ("layer", "batch")),
        ("lstm", "layer", torch.float16),
        ("gru", "batch", torch.float16),
    ]
]


@pytest.mark.parametrize(("kind", "norm", "half"), HALF_CASES)
def test_under_autocast_each_step_product_takes_half_precision_operands(
    kind: str, norm: str, half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under autocast each step's ``W_hh h`` (and its backward's product) takes its operands in autocast's dtype
    and sums them in full precision. In float64, with that product forced (autocast lowers float32 only): the
    outputs, states and BN's running statistics equal the plain path's with ``h`` and ``W_hh`` rounded where they
    enter the product, within 1e-12 (padded rows, both directions), and differ from the unrounded ones
    by the rounding; the gradients are within the rounding of the rounded path's (the backward's product rounds
    its left operand too)."""
    from seqnorm.layers import compiled

    torch.manual_seed(4)
    layer = seqnorm.LAYERS[kind](4, 6, bidirectional=True, **_options(norm, 3)).double()
    perturb_norm_parameters(layer)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4])
    weights = [torch.randn(5, 3, 12, dtype=torch.float64)] + [torch.randn(2, 3, 6, dtype=torch.float64)] * (
        2 if kind == "lstm" else 1
    )
    with kernels.disabled():
        unrounded = _run(layer, x, lengths, weights)
        with monkeypatch.context() as patch:
            _rounded_products(patch, half)
            rounded = _run(layer, x, lengths, weights)
    monkeypatch.setattr(compiled, "_half_products", lambda device, dtype: {"half": half})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.plan(x).path == "triton"
        fast = _run(layer, x, lengths, weights)
    states = 3 if kind == "lstm" else 2
    buffers = [*range(len(fast) - 1 - len(list(layer.buffers())), len(fast) - 1)]
    for index in [*range(states), *buffers]:
        torch.testing.assert_close(fast[index], rounded[index], rtol=1e-12, atol=1e-12)
    assert (fast[0] - unrounded[0]).abs().max() > 1e-4  # the rounding is there
    for index in range(states, len(fast) - 1 - len(buffers)):
        scale = rounded[index].abs().max().clamp(min=1)
        assert (fast[index] - rounded[index]).abs().max() <= 2e-2 * scale, index


def test_autocast_hands_the_backend_its_dtype_for_float32_parameters_only(
    triton_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's ``half``: autocast's dtype where the parameters are float32, nothing for float64 (which
    autocast does not lower), nothing outside autocast."""
    received: list[dict[str, Any]] = []
    real = triton_backend.lstm_forward

    def record(*args: Any, **options: Any) -> Any:
        received.append(options)
        return real(*args, **options)

    monkeypatch.setattr(triton_backend, "lstm_forward", record)
    for dtype, autocast in ((torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, None),
                            (torch.float32, None), (torch.float64, torch.bfloat16)):  # fmt: skip
        layer = seqnorm.LSTM(3, 4, norm="layer").to(dtype)
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            layer(torch.randn(2, 2, 3, dtype=dtype))
    assert received == [{"half": torch.bfloat16}, {"half": torch.float16}, {}, {}, {}]


# --- bad calls: every entry point checks its arguments before a kernel reads them ---


def _recorded(backend: Any, monkeypatch: pytest.MonkeyPatch, kind: str, norm: str) -> dict[str, tuple]:
    """The arguments the layer hands each entry point: a training step and a generation step."""
    calls: dict[str, tuple] = {}
    for entry in (f"{kind}_forward", f"{kind}_backward", "generation_step"):
        real = getattr(backend, entry)

        def record(*args: Any, _entry: str = entry, _real: Any = real) -> Any:
            calls.setdefault(_entry, args)
            return _real(*args)

        monkeypatch.setattr(backend, entry, record)
    layer = seqnorm.LAYERS[kind](3, 4, norm=norm)
    output, _ = layer(torch.randn(3, 2, 3, requires_grad=True), lengths=torch.tensor([3, 2]))
    output.sum().backward()
    with torch.no_grad():
        layer.eval().step(torch.randn(2, 3))
    monkeypatch.undo()
    return calls


def _bad_variants(args: tuple) -> list[tuple[int, str, Any]]:
    """(argument index, what is wrong, the bad value) for each tensor argument and norm."""
    variants: list[tuple[int, str, Any]] = []
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            variants.append((index, "shape", value.reshape(-1)[:-1]))
            variants.append((index, "dtype", value.to(torch.float16 if value.is_floating_point() else torch.float32)))
            if value.dim() >= 2:
                variants.append((index, "strides", value.transpose(-1, -2).contiguous().transpose(-1, -2)[..., :-1]))
        elif isinstance(value, kernels.KernelNorm) and value.weight is not None:
            variants.append((index, "γ", dataclasses.replace(value, weight=value.weight[:-1])))
            if value.folded_scale is not None:  # evaluation's generation step reads the folded rows only
                variants.append((index, "folded", dataclasses.replace(value, folded_scale=value.folded_scale[:, 1:])))
            elif value.running_mean is not None:
                variants.append((index, "running", dataclasses.replace(value, running_mean=value.running_mean[:, 1:])))
    return variants


@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_every_entry_point_refuses_what_it_cannot_run(
    triton_backend: Any, monkeypatch: pytest.MonkeyPatch, kind: str, norm: str
) -> None:
    calls = _recorded(triton_backend, monkeypatch, kind, norm)
    assert set(calls) == {f"{kind}_forward", f"{kind}_backward", "generation_step"}
    refused = 0
    for entry, args in calls.items():
        for index, what, value in _bad_variants(args):
            bad = (*args[:index], value, *args[index + 1 :])
            try:
                with torch.no_grad():  # as autograd calls the backward, and the layers the forward without a graph
                    getattr(triton_backend, entry)(*bad)
            except (ValueError, TypeError) as error:
                assert str(error).startswith(f"seqnorm kernels: {entry}: expected "), (index, what, error)
            else:
                pytest.fail(f"{entry}: argument {index} with a wrong {what} was accepted")
            refused += 1
    assert refused >= 20
    cell, x, h, c, *rest = calls["generation_step"]
    with pytest.raises(ValueError, match="generation_step: expected cell 'lstm' or 'gru', got 'rnn'"):
        triton_backend.generation_step("rnn", x, h, c, *rest)
    if kind == "lstm":
        with pytest.raises(ValueError, match=r"generation_step: expected c of shape \(1, B, H\)"):
            triton_backend.generation_step(cell, x, h, None, *rest)


@pytest.mark.parametrize("norm", KERNEL_NORMS)
def test_a_forward_without_lengths_reads_nothing_back_from_the_device(norm: str) -> None:
    """No host read in the whole forward (what CUDA-graph capture needs), BN's running statistics and fallback count
    included; with lengths, the layer reads the lengths once to lay out the padding."""
    layer = seqnorm.LSTM(4, 6, norm=norm, num_layers=2)
    x = torch.randn(5, 3, 4, requires_grad=True)
    assert layer.plan(x).path == "triton"
    layer(x)
    with _Ops() as ops:
        layer(x)
    assert not [name for name in ops.names if name in _SYNCS]


_HOST_READS = {"item", "tolist", "cpu", "numpy"}  # methods that read a device tensor back to the host (a sync)
_CONVERSIONS = {"int", "float", "bool"}  # int(tensor) and the like: the same, written as a conversion


def _host_reads_in_loops(source: str) -> list[str]:
    """Every host read of a tensor inside a ``for``/``while`` loop of ``source``: ``.item()``, ``.tolist()``,
    ``.cpu()``, ``.numpy()``, and ``int/float/bool(x)`` of anything but a literal or a ``len(...)``."""
    found = []
    for loop in (node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.For | ast.While)):
        for node in ast.walk(loop):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr in _HOST_READS:
                found.append(f"line {node.lineno}: .{node.func.attr}()")
            elif isinstance(node.func, ast.Name) and node.func.id in _CONVERSIONS and node.args:
                argument = node.args[0]
                harmless = isinstance(argument, ast.Constant) or (
                    isinstance(argument, ast.Call) and isinstance(argument.func, ast.Name) and argument.func.id == "len"
                )
                if not harmless:
                    found.append(f"line {node.lineno}: {node.func.id}(...)")
    return found


def test_no_loop_of_the_triton_backend_reads_a_tensor_back_to_the_host() -> None:
    """A host read inside the time loop is a device synchronization every step (the launch test counts syncs on the
    CPU, where none shows): checked in the source of every module of the backend."""
    package = Path(seqnorm.kernels.__file__).parent / "triton_backend"
    found = {path.name: _host_reads_in_loops(path.read_text(encoding="utf-8")) for path in package.glob("*.py")}
    assert {name: reads for name, reads in found.items() if reads} == {}
    # and the check finds what it looks for
    planted = "for t in range(steps):\n    n = int(lengths[t])\n    x = y.item() + z.cpu().sum() + int(len(a))\n"
    assert _host_reads_in_loops(planted) == ["line 2: int(...)", "line 3: .item()", "line 3: .cpu()"]


# --- the loops as graphs (seqnorm.kernels.triton_backend.graphs), with a stand-in graph on CPU tensors ---


class Replayed:
    """A stand-in graph for tests on CPU tensors: capturing runs the loop on the static inputs, and a replay runs it
    again from them into the same output tensors, as a CUDA graph's replay writes its static outputs. A loop that
    read anything but its arguments, or a caller that kept a static output, gives other numbers than eager here."""

    def __init__(self, loop: Any, inputs: Any, settings: dict[str, Any]) -> None:
        self.loop, self.inputs, self.settings = loop, inputs, settings
        self.outputs = loop(*inputs, **settings)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for static, fresh in zip(self.outputs, self.loop(*self.inputs, **self.settings), strict=True):
            static.copy_(fresh)


@pytest.fixture
def stand_in_graphs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The backend's loops graphed on CPU tensors: :class:`Replayed` replays a captured loop from its static
    inputs into its static outputs, as a CUDA graph does."""
    from seqnorm.kernels.triton_backend import graphs

    made: list[Any] = []

    def capture(loop: Any, inputs: Any, settings: Any) -> Any:
        made.append(Replayed(loop, inputs, settings))
        return made[-1]

    loops = graphs.LoopGraphs(capture=capture, devices=("cpu",))
    monkeypatch.setattr(graphs, "GRAPHS", loops)
    monkeypatch.delenv(graphs.ENV, raising=False)
    loops.made = made
    return loops


def _calls(kind: str, norm: str, graphed: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Calls of one bidirectional float64 layer (its two directions share the loops' keys), each forward and
    backward, on new inputs and lengths of the same longest length: the capture, then, with the weights changed in
    place, two forwards before their backwards. Every output, state and gradient, in order, and the buffers (BN's
    running statistics, updated in place by the forward loop) after each backward."""
    from seqnorm.kernels.triton_backend import graphs

    monkeypatch.setenv(graphs.ENV, "1" if graphed else "0")
    monkeypatch.setattr(graphs, "WARMUPS", 0)  # captured on the first call (the warm-ups: the next test)
    torch.manual_seed(3)
    layer = seqnorm.LAYERS[kind](2, 3, bidirectional=True, norm=norm).double()
    perturb_norm_parameters(layer)
    calls = graphs.WARMUPS + 3
    inputs = [torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True) for _ in range(calls)]
    lengths = [torch.tensor([2, 1, 1 + call % 2]) for call in range(calls)]  # padding in every call: a mask
    results: list[Any] = []

    def backward(output: torch.Tensor, state: Any, x: torch.Tensor) -> None:
        states = state if isinstance(state, tuple) else (state,)
        (output.sum() + sum(s.square().sum() for s in states)).backward()
        results.extend([output.detach(), *(s.detach() for s in states), x.grad])
        results.extend(p.grad.clone() for p in layer.parameters())
        results.extend(buffer.clone() for buffer in layer.buffers())
        layer.zero_grad()

    backward(*layer(inputs[0], lengths=lengths[0]), inputs[0])  # the capture
    with torch.no_grad():
        for parameter in layer.parameters():  # changed in place: the graph reads them through its static copies
            parameter.mul_(1.1)
    second = layer(inputs[-2], lengths=lengths[-2])
    third = layer(inputs[-1], lengths=lengths[-1])  # replayed while the second call's outputs wait for their backward
    for (output, state), x in ((second, inputs[-2]), (third, inputs[-1])):
        backward(output, state, x)
    return results


@pytest.mark.parametrize("norm", ["layer", "batch"])  # the two layouts
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_graphed_loops_equal_the_eager_ones(
    stand_in_graphs: Any, monkeypatch: pytest.MonkeyPatch, kind: str, norm: str
) -> None:
    eager = _calls(kind, norm, False, monkeypatch)
    assert not stand_in_graphs.made
    graphed = _calls(kind, norm, True, monkeypatch)
    assert len(stand_in_graphs) == len(stand_in_graphs.made) == 2  # the forward loop's and the backward loop's
    assert all(graph.replays >= 5 for graph in stand_in_graphs.made)  # 3 calls, 2 directions each
    assert len(graphed) == len(eager)
    for index, (got, expected) in enumerate(zip(graphed, eager, strict=True)):
        # float64, the same operations; the static copies sit at other addresses than the originals (h0's slice of
        # the state, say), and a BLAS may take another code path for another alignment: within 1e-12, not bitwise
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=str(index))


def test_a_graph_per_key_at_most_the_limit_and_eager_where_capture_fails(
    stand_in_graphs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from seqnorm.kernels.triton_backend import graphs

    def loop(x: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, ...]:
        return (x * scale,)

    stand_in_graphs.limit = 1
    for _ in range(3):
        for size in (2, 3):  # two keys, alternately: the limit of one evicts the other each time
            x = torch.randn(size)
            assert torch.equal(graphs.run("loop", loop, [x], scale=2.0)[0], x * 2)
    assert len(stand_in_graphs) == 1

    def failing(loop: Any, inputs: Any, settings: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    stand_in_graphs.capture = failing
    x = torch.randn(4)
    for _ in range(graphs.WARMUPS):
        graphs.run("loop", loop, [x], scale=3.0)
    with pytest.warns(RuntimeWarning, match=r"runs without a CUDA graph for this shape: capturing it failed"):
        assert torch.equal(graphs.run("loop", loop, [x], scale=3.0)[0], x * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the key stays eager
        assert torch.equal(graphs.run("loop", loop, [x + 1], scale=3.0)[0], (x + 1) * 3)

    class Wrong:
        def __init__(self, loop: Any, inputs: Any, settings: Any) -> None:
            self.outputs = (torch.zeros(5),)

        def replay(self) -> None:
            pass

    stand_in_graphs.capture = Wrong
    for _ in range(graphs.WARMUPS):
        graphs.run("loop", loop, [torch.randn(5)], scale=1.0)
    with pytest.warns(RuntimeWarning, match="its graph's replay differed from the eager loop"):
        y = torch.randn(5)
        assert torch.equal(graphs.run("loop", loop, [y], scale=1.0)[0], y)
    assert not stand_in_graphs.wanted([torch.randn(6, 1).expand(6, 2)])  # one element twice: never graphed
    assert not stand_in_graphs.wanted([torch.randn(6, 4)[:, :2]])  # gaps
    assert stand_in_graphs.wanted([torch.randn(6, 2).t(), torch.randn(6)])  # a transposed weight is dense
    monkeypatch.setenv(graphs.ENV, "0")
    assert not stand_in_graphs.wanted([torch.randn(6)])


# both cells, both kinds of step norm (BN in evaluation: its step's row of folded scale and offset)
@pytest.mark.parametrize(("kind", "norm"), [("lstm", "batch"), ("gru", "layer")])
def test_graphed_generation_steps_equal_the_eager_ones(
    stand_in_graphs: Any, monkeypatch: pytest.MonkeyPatch, kind: str, norm: str
) -> None:
    from seqnorm.kernels.triton_backend import graphs

    torch.manual_seed(5)
    layer = seqnorm.LAYERS[kind](3, 4, num_layers=2, norm=norm).double()
    perturb_norm_parameters(layer)
    layer.train()(torch.randn(3, 4, 3, dtype=torch.float64))  # BN's running statistics, every step's its own
    layer.eval()
    xs = torch.randn(5, 2, 3, dtype=torch.float64)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv(graphs.ENV, on)
        state, outputs = None, []
        with torch.no_grad():
            assert plan_for(layer, xs[0], step=True).cells == ("triton", "triton")
            for x in xs:  # steps 0-4: BN reads its step's row of statistics (3-4: rows training never reached)
                output, state = layer.step(x, state)
                outputs.append(output)
        runs.append(outputs)
    assert stand_in_graphs.made and all(graph.replays >= 1 for graph in stand_in_graphs.made)
    for got, expected in zip(runs[1], runs[0], strict=True):  # float64; other addresses: see the test above
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# --- direct launches: what a GPU's launch gets, checked with Triton's own binder (no GPU needed) ---


class _Compiled:
    """A compiled kernel's stand-in: records what its launcher receives."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list[tuple[Any, ...]]) -> None:
        self.launches = launches

    def run(self, *arguments: Any) -> None:
        self.launches.append(arguments)


class _Kernel:
    """A JIT-compiled kernel's stand-in: ``kernel[grid](...)`` (Triton's own launch) is counted and returns a
    :class:`_Compiled`; ``jit`` is the real ``JITFunction`` whose binder the direct launches consult."""

    def __init__(self, jit: Any, launches: list[tuple[Any, ...]]) -> None:
        self.jit, self.launches, self.through_triton = jit, launches, 0

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **constexprs: Any) -> _Compiled:
            self.through_triton += 1
            return _Compiled(self.launches)

        return run


def _recorded_step_launches() -> list[tuple[Any, Any, tuple, dict]]:
    """Every kernel launch of a masked LSTM's forward and backward (LN; the interpreter runs them): the kernel's
    function, the grid, the arguments and the compile-time constants."""
    from triton.runtime import interpreter

    recorded: list[tuple[Any, Any, tuple, dict]] = []
    run = interpreter.InterpretedFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: Any, **constexprs: Any) -> Any:
        recorded.append((self.fn, grid, args, constexprs))
        return run(self, *args, grid=grid, warmup=warmup, **constexprs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpretedFunction, "run", record)
        layer = seqnorm.LSTM(3, 5, norm="layer")
        output, _ = layer(torch.randn(6, 3, 3, requires_grad=True), lengths=torch.tensor([6, 4, 5]))
        output.sum().backward()
    return recorded


def test_a_direct_launch_passes_what_tritons_launch_passes_for_the_same_specialization_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop's repeated launches skip Triton's ``kernel[grid](...)``: the first of a specialization goes through it
    and gives the compiled kernel; the later ones call its launcher with the grid, the stream, no hooks and every
    argument in the kernel's signature order (constexprs included, pointers as their addresses: what Triton's own
    launch passes). Which launches share a specialization is what Triton's binder says (for an sm_90 target): a
    pointer off 16-byte alignment, an integer argument turned a multiple of 16 goes through Triton again. Off with
    ``SEQNORM_DIRECT_LAUNCH=0`` and while a launch hook is set."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from seqnorm.kernels.triton_backend import launch as launching

    recorded = [launched for launched in _recorded_step_launches() if launched[0].__name__ == "lstm_step"]
    assert len(recorded) == 6  # one a time step

    class StubDriver:  # what making the binder asks of the CUDA driver
        def get_current_device(self) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", StubDriver())
    jit = JITFunction(recorded[0][0])  # the kernel a GPU compiles (the interpreter's is another class)
    device, binder = launching.binder_of(jit)
    direct_launches: list[tuple[Any, ...]] = []
    kernel = _Kernel(jit, direct_launches)
    hooked = [False]
    launches = launching.DirectLaunches(
        binder=lambda kernel, first: launching.binder_of(kernel.jit), stream=lambda device: 7, hooked=lambda: hooked[0]
    )

    def expected(args: tuple, constexprs: dict) -> list[Any]:
        bound = inspect.signature(jit.fn).bind(*args, **constexprs)
        bound.apply_defaults()
        return [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in bound.arguments.values()]

    specializations = {tuple(binder(*args, **constexprs)[1]) for _, _, args, constexprs in recorded}
    for _, grid, args, constexprs in recorded:
        before = len(direct_launches)
        launches(kernel, grid, *args, **constexprs)
        if len(direct_launches) > before:
            assert direct_launches[-1][:9] == (grid[0], 1, 1, 7, "function", "metadata", None, None, None)
            assert list(direct_launches[-1][9:]) == expected(args, constexprs)
    assert kernel.through_triton == len(specializations)
    assert len(direct_launches) == len(recorded) - len(specializations) > 0

    _, grid, args, constexprs = recorded[-1]
    tensor = next(index for index, arg in enumerate(args) if isinstance(arg, torch.Tensor))
    shifted = list(args)
    shifted[tensor] = torch.empty(args[tensor].numel() + 1, dtype=args[tensor].dtype)[1:].view_as(args[tensor])
    hidden = list(args)
    at = list(inspect.signature(jit.fn).parameters).index("hidden")
    assert hidden[at] == 5
    hidden[at] = 16  # a multiple of 16
    for changed in (shifted, hidden):
        assert tuple(binder(*changed, **constexprs)[1]) not in specializations
        before = kernel.through_triton
        launches(kernel, grid, *changed, **constexprs)
        assert kernel.through_triton == before + 1, "a new specialization went past Triton"
    for off in ("environment", "hook"):
        before = (kernel.through_triton, len(direct_launches))
        with monkeypatch.context() as patch:
            if off == "environment":
                patch.setenv(launching.ENV, "0")
            hooked[0] = off == "hook"
            launches(kernel, grid, *args, **constexprs)
        hooked[0] = False
        assert (kernel.through_triton, len(direct_launches)) == (before[0] + 1, before[1]), off
    assert device == 0
