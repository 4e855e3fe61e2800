"""The compiled kernels' bindings refuse what they cannot run, and hold their aliasing contract.

Every entry point of ``seqnorm.kernels.native("cpu")`` is called with the arguments the library itself passes
(recorded by wrapping the native module during real layer calls), then with one argument at a time made wrong: a
dtype, a shape, contiguity, a missing optional tensor, a norm's γ of the wrong length... Each bad call must raise a
Python exception that names the entry point and the argument. The bad calls run in one subprocess (this file run as a
script), which prints a line per call: a call that crashes the process fails the test instead of the test run.

The aliasing contract (``seqnorm/kernels/__init__.py``, the bindings in ``csrc/bindings.cpp``): every result is a
fresh tensor; the only arguments written are a per-timestep BatchNorm's running statistics in training, which may
share memory with no other argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import seqnorm
from seqnorm import kernels

ROOT = Path(__file__).resolve().parents[2]  # the subprocess imports this checkout's seqnorm (PYTHONPATH)

# The bindings' parameters, in order (pybind11 names them arg0, arg1, ... without these).
SIGNATURES = {
    "lstm_forward": "inputs h0 c0 weight_hh mask ih hh c save",
    "lstm_backward": "grad_hs grad_h_n grad_c_n inputs h0 c0 weight_hh mask hs saved raw stats ih hh c sequence "
    "weight_ih want_x want_weight",
    "gru_forward": "inputs h0 weight_hh mask ih hh save",
    "gru_backward": "grad_hs grad_h_n inputs h0 weight_hh mask hs saved stats ih hh sequence weight_ih want_x "
    "want_weight",
    "generation_step": "cell x h c weight_ih_t weight_hh_t ih hh c_norm step",
    "norm_step": "x weight shift mask norm step module",
}
# The tensors each binding indexes as dense rows (the others may be strided views).
DENSE = {
    "lstm_forward": {"inputs", "h0", "c0"},
    "lstm_backward": {"grad_hs", "grad_h_n", "grad_c_n", "inputs", "h0", "c0", "hs", "raw"},
    "gru_forward": {"inputs", "h0"},
    "gru_backward": {"grad_hs", "grad_h_n", "inputs", "h0", "hs"},
    "generation_step": set(),
    "norm_step": {"x"},
}
# A norm step's γ and shift: the norm's own (the node returns their gradients), so any other tensor is refused.
OWN = {"norm_step": {"weight": "norm.weight", "shift": "norm.shift"}}
NORMS = {"ih", "hh", "c", "c_norm", "norm"}


class Spec:
    """A ``NormArgs`` as keyword arguments, made into the native object at each call (so that a case can vary it)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def but(self, **changes: Any) -> Spec:
        return Spec(**{**self.kwargs, **changes})


class Recorder:
    """The native module, recording each entry point's arguments (norms as :class:`Spec`) as the library calls it."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, list[list[Any]]] = {name: [] for name in SIGNATURES}

    def NormArgs(self, **kwargs: Any) -> Spec:  # the binding's name
        return Spec(**kwargs)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.module, name)
        if name not in SIGNATURES:
            return attribute

        def record(*args: Any) -> Any:
            self.calls[name].append(list(args))
            return attribute(*native_args(self.module, args))

        return record


def native_args(module: Any, args: Any) -> list[Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Spec):
            return module.NormArgs(**value.kwargs)
        return value

    return [convert(value) for value in args]


def capture() -> dict[str, list[Any]]:
    """One real call of each entry point, as the layers make it: an LSTM with LayerNorm everywhere (the input norm in
    the kernel: the projection handed over) and a GRU with per-timestep BatchNorm in training, forward and backward,
    with padding; the generation step of an LSTM with BatchNorm in evaluation (folded statistics) and of a GRU with
    LayerNorm; a masked training step of an LSTM cell with BatchNorm in a loop of the user's own (one norm's step)."""
    native = kernels.native("cpu")
    recorder = Recorder(native)
    kernels._LOADED["cpu"] = recorder  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        x = torch.randn(5, 4, 3, dtype=torch.float64)
        lengths = torch.tensor([5, 4, 5, 3])
        for layer_type, norm in ((seqnorm.LSTM, "layer"), (seqnorm.GRU, "batch")):
            layer = layer_type(3, 8, norm=norm, dtype=torch.float64).train()
            output, _ = layer(x, lengths=lengths)
            output.sum().backward()
        for layer_type, norm in ((seqnorm.LSTM, "batch"), (seqnorm.GRU, "layer")):
            layer = layer_type(3, 8, norm=norm, dtype=torch.float64).eval()
            with torch.no_grad():
                layer.step(x[0])
        cell = seqnorm.LSTMCell(3, 8, norm="batch", dtype=torch.float64).train()
        h, c = cell(x[0], step=0, mask=lengths > 3)
        (h.sum() + c.sum()).backward()
    finally:
        kernels._LOADED["cpu"] = native
    missing = [name for name, calls in recorder.calls.items() if not calls]
    assert not missing, f"no real call of {missing}"
    return {name: calls[0] for name, calls in recorder.calls.items()}


# --- the bad calls ---

Case = tuple[str, str, list[Any], str]  # (binding, what is wrong, arguments, what the message must name)


def _other_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float32 if tensor.dtype == torch.float64 else torch.float64


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values and shape, not contiguous (every other element of a wider tensor)."""
    wide = tensor.new_zeros(*tensor.shape[:-1], 2 * tensor.shape[-1])
    view = wide[..., ::2]
    view.copy_(tensor)
    assert not view.is_contiguous()
    return view


def _grown(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """One more slice along ``dim``."""
    return torch.cat([tensor, tensor.narrow(dim, 0, 1)], dim)


def bad_calls(baseline: dict[str, list[Any]]) -> Iterator[Case]:
    for binding, args in baseline.items():
        names = SIGNATURES[binding].split()

        def but(index: int, value: Any, args: list[Any] = args) -> list[Any]:
            changed = list(args)
            changed[index] = value
            return changed

        for index, (name, value) in enumerate(zip(names, args, strict=True)):
            if name in OWN.get(binding, {}):
                if value is not None:
                    yield binding, f"{name} a copy of {OWN[binding][name]}", but(index, value.clone()), name
                    yield binding, f"{name} missing", but(index, None), name
                else:
                    x = args[names.index("x")]
                    other = x.new_zeros(x.shape[-1])
                    yield binding, f"{name} given where {OWN[binding][name]} is None", but(index, other), name
                continue
            if isinstance(value, torch.Tensor):
                first = index == (1 if binding == "generation_step" else 0)
                # The first tensor sets the call's dtype: another float would name the next tensor instead.
                dtype = torch.int32 if first else (torch.float32 if value.dtype == torch.bool else _other_dtype(value))
                yield binding, f"{name} of dtype {dtype}", but(index, value.to(dtype)), name
                dim = 0 if name == "weight_ih" else -1  # I is weight_ih's: a wider one names the sequence
                # F is x's: the weight disagrees (W_ih^T of the generation step, a norm step's γ)
                named = {"generation_step": "weight_ih_t"}.get(binding, "norm.weight") if name == "x" else name
                yield binding, f"{name} one wider", but(index, _grown(value, dim)), named
                if name in DENSE[binding]:
                    yield binding, f"{name} not contiguous", but(index, _strided(value)), "contiguous"
                else:
                    yield binding, f"{name} strided (allowed)", but(index, _strided(value)), ""
            elif isinstance(value, Spec):
                yield from _norm_cases(binding, name, index, value, but)
            elif name in ("saved", "stats"):
                yield binding, f"{name} one short", but(index, value[:-1]), name
        yield from _specific_cases(binding, names, args, but)


def _norm_cases(binding: str, name: str, index: int, spec: Spec, but: Callable[..., list[Any]]) -> Iterator[Case]:
    weight, shift = spec.kwargs["weight"], spec.kwargs["shift"]
    yield binding, f"{name} of an unknown kind", but(index, spec.but(kind="group")), f"{name}.kind"
    yield binding, f"{name} with eps < 0", but(index, spec.but(eps=-1.0)), f"{name}.eps"
    if weight is None:
        yield binding, f"{name} of kind none with a γ", but(index, spec.but(weight=torch.ones(3))), f"{name}.weight"
        return
    yield binding, f"{name} γ of 3 values", but(index, spec.but(weight=weight[:3].clone())), f"{name}.weight"
    yield binding, f"{name} without γ", but(index, spec.but(weight=None)), f"{name}.weight"
    yield binding, f"{name} γ of another dtype", but(index, spec.but(weight=weight.float())), f"{name}.weight"
    shift = weight if shift is None else shift
    yield binding, f"{name} shift of 3 values", but(index, spec.but(shift=shift[:3].clone())), f"{name}.shift"
    if spec.kwargs["kind"] != "batch":
        extra = torch.zeros(2, weight.shape[0], dtype=weight.dtype)
        yield binding, f"{name} with running statistics", but(index, spec.but(running_mean=extra)), name
        return
    mean, var, tracked = (spec.kwargs[key] for key in ("running_mean", "running_var", "num_batches_tracked"))
    yield binding, f"{name} without running_mean", but(index, spec.but(running_mean=None)), f"{name}.running_mean"
    yield binding, f"{name} running_var of a row more", but(index, spec.but(running_var=_grown(var, 0))), "running_var"
    yield binding, f"{name} running_var of a feature less", but(index, spec.but(running_var=var[:, 1:])), "running_var"
    yield (binding, f"{name} strided running_mean", but(index, spec.but(running_mean=_strided(mean))), "contiguous")
    yield (
        binding,
        f"{name} float batches tracked",
        but(index, spec.but(num_batches_tracked=tracked.double())),
        f"{name}.num_batches_tracked",
    )
    yield (binding, f"{name} renorm r_max_steps 0", but(index, spec.but(renorm=True, r_max_steps=0)), "renormalization")
    if spec.kwargs["training"] and not binding.endswith("backward"):
        # The running statistics are updated in place: one buffer for both would be written twice.
        yield binding, f"{name} running_var is running_mean", but(index, spec.but(running_var=mean)), "share no memory"
    if binding != "generation_step":
        folded = torch.zeros_like(mean)
        yield (
            binding,
            f"{name} folded statistics",
            but(index, spec.but(folded_scale=folded, folded_offset=folded)),
            "folded",
        )
    elif spec.kwargs["folded_scale"] is not None:
        yield binding, f"{name} folded_offset missing", but(index, spec.but(folded_offset=None)), "folded_offset"
        rows = spec.kwargs["folded_scale"][:, :3].clone()
        yield binding, f"{name} folded_scale of 3 features", but(index, spec.but(folded_scale=rows)), "folded_scale"


def _specific_cases(binding: str, names: list[str], args: list[Any], but: Callable[..., list[Any]]) -> Iterator[Case]:
    at = {name: index for index, name in enumerate(names)}
    if binding == "generation_step":
        lstm = args[at["cell"]] == "lstm"
        yield binding, "an unknown cell", but(at["cell"], "peephole"), "cell"
        yield binding, "a cell of another case", but(at["cell"], args[at["cell"]].upper()), "cell"
        if lstm:
            yield binding, "LSTM without c", but(at["c"], None), "c (the LSTM cell state)"
            yield binding, "LSTM weights as a GRU", but(at["cell"], "gru"), "weight_ih_t"
        else:
            h = args[at["h"]]
            yield binding, "GRU with c", but(at["c"], torch.zeros_like(h)), "c"
            yield binding, "GRU weights as an LSTM", but(at["cell"], "lstm"), "weight_ih_t"
        yield binding, "a negative time index", but(at["step"], -1), "step"
        yield binding, "x of 4 dimensions", but(at["x"], args[at["x"]][None, None]), "x"
        yield binding, "h of 2 layers", but(at["h"], _grown(args[at["h"]], 0)), "h"
    if binding == "norm_step":
        yield binding, "a negative time index", but(at["step"], -1), "step"
        yield binding, "x of 3 dimensions", but(at["x"], args[at["x"]][None]), "x"
    if binding.endswith("backward"):
        saved = args[at["saved"]]
        yield binding, "saved[0] one wider", but(at["saved"], [_grown(saved[0]), *saved[1:]]), "saved"
    if binding.endswith("backward") and "stats" in at:
        if binding == "lstm_backward":
            yield (
                binding,
                "saved acts strided",
                but(at["saved"], [saved[0], _strided(saved[1]), saved[2]]),
                "contiguous",
            )
            yield binding, "raw missing", but(at["raw"], None), "raw"
        stats = args[at["stats"]]
        yield binding, "ih's stats one short", but(at["stats"], [stats[0][:-1], *stats[1:]]), "stats of ih"
        means = stats[0][0]  # a GRU's BN may keep none (0,): the backward recomputes them
        wrong = [[_grown(means, 0) if means.numel() else means.new_zeros(1), *stats[0][1:]], *stats[1:]]
        yield binding, "ih's saved means of a step more", but(at["stats"], wrong), "ih.saved means"
        if args[at["sequence"]] is not None:
            yield binding, "sequence without weight_ih", but(at["weight_ih"], None), "weight_ih"
            yield binding, "weight_ih without sequence", but(at["sequence"], None), "sequence"
    if binding.endswith("forward") or binding == "norm_step":
        mask = args[at["mask"]]
        if mask is not None:
            yield binding, "mask of a step less", but(at["mask"], mask[1:]), "mask"


def other_bindings(native: Any) -> Iterator[tuple[str, Callable[[], Any], str]]:
    yield "product_route", lambda: native.product_route(torch.ones(4, 4, dtype=torch.int64), 2), "right"
    yield "product_route", lambda: native.product_route(torch.ones(4), 2), "right"
    yield "product_route", lambda: native.product_route(torch.ones(4, 4), 0), "rows"
    yield "product_candidates", lambda: native.product_candidates(0), "rows"
    yield "saved_empty", lambda: native.saved_empty([2, -3], torch.float32), "sizes"


def run_table() -> None:
    """The subprocess: each bad call, a JSON line before it (flushed: a crash leaves the call that caused it) and
    one after with its outcome."""
    native = kernels.native("cpu")
    baseline = capture()
    calls: list[tuple[str, str, Callable[[], Any], str]] = []
    for binding, what, args, named in bad_calls(baseline):
        calls.append((binding, what, lambda b=binding, a=args: getattr(native, b)(*native_args(native, a)), named))
    for binding, thunk, named in other_bindings(native):
        calls.append((binding, "bad argument", thunk, named))
    for binding, what, thunk, named in calls:
        print(json.dumps({"start": [binding, what]}), flush=True)
        try:
            with torch.no_grad():  # as the library calls most (inside an autograd Function, or generating)
                thunk()
            outcome = {"raised": None, "message": ""}
        except Exception as error:  # every exception is reported to the test
            outcome = {"raised": type(error).__name__, "message": str(error).splitlines()[0]}
        print(json.dumps({"binding": binding, "what": what, "named": named, **outcome}), flush=True)


# --- the tests ---


@pytest.fixture(scope="module")
def native() -> Any:
    module = kernels.native("cpu")
    if module is None:
        pytest.skip(f"the compiled kernels are not loaded: {kernels.status()}")
    return module


@pytest.fixture(scope="module")
def table(native: Any) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    last = next((line["start"] for line in reversed(lines) if "start" in line), None)
    assert done.returncode == 0, f"the bad calls' process died ({done.returncode}) at {last}: {done.stderr[-2000:]}"
    return [line for line in lines if "start" not in line]


def _as_expected(result: dict[str, Any]) -> bool:
    if result["named"] == "":  # a strided tensor the binding reads through strides: accepted
        return result["raised"] is None
    message = result["message"]
    return (
        result["raised"] in ("ValueError", "TypeError")
        and f"seqnorm kernels: {result['binding']}: " in message
        and result["named"] in message
    )


def test_every_bad_call_raises_an_error_naming_the_argument(table: list[dict[str, Any]]) -> None:
    assert len(table) > 100
    wrong = [result for result in table if not _as_expected(result)]
    assert not wrong, "\n".join(json.dumps(result) for result in wrong)


def test_every_binding_is_probed(table: list[dict[str, Any]]) -> None:
    probed = {result["binding"] for result in table}
    assert set(SIGNATURES) | {"product_route", "product_candidates", "saved_empty"} <= probed


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Spec):
        for item in value.kwargs.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _written(args: list[Any]) -> set[int]:
    """The storages the contract lets a call write: a per-timestep BN's running statistics in training."""
    written = set()
    for value in args:
        if isinstance(value, Spec) and value.kwargs["kind"] == "batch" and value.kwargs["training"]:
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                written.add(value.kwargs[key].untyped_storage().data_ptr())
    return written


@pytest.mark.parametrize("binding", list(SIGNATURES))
def test_results_alias_no_argument_and_only_running_statistics_are_written(native: Any, binding: str) -> None:
    """Each result is fresh: poisoning every argument with NaN after the call leaves the results as they were; and
    every argument the contract does not let the call write is unchanged."""
    args = capture()[binding]
    before = [tensor.clone() for tensor in _tensors(args)]
    with torch.no_grad():
        results = getattr(native, binding)(*native_args(native, args))
    written = _written(args)
    for tensor, old in zip(_tensors(args), before, strict=True):
        if tensor.untyped_storage().data_ptr() in written:
            continue
        # equal_nan: BN's folded rows beyond the steps reached are not filled yet (uninitialized)
        message = f"{binding} wrote an argument of shape {tuple(tensor.shape)}"
        torch.testing.assert_close(tensor, old, rtol=0, atol=0, equal_nan=True, msg=message)
    kept = [result.clone() for result in _tensors(results)]
    with torch.no_grad():
        for tensor in _tensors(args):
            tensor.fill_(float("nan") if tensor.is_floating_point() else 0)
    for result, copy in zip(_tensors(results), kept, strict=True):
        assert torch.equal(result, copy), f"a result of {binding} of shape {tuple(result.shape)} aliases an argument"


def test_batch_norm_in_training_writes_its_running_statistics(native: Any) -> None:
    """The one documented write: the GRU's per-timestep BN updates its running moments and counters in place."""
    args = capture()["gru_forward"]
    specs = [value for value in args if isinstance(value, Spec) and value.kwargs["kind"] == "batch"]
    assert specs and all(spec.kwargs["training"] for spec in specs)
    before = [spec.kwargs["num_batches_tracked"].clone() for spec in specs]
    with torch.no_grad():
        native.gru_forward(*native_args(native, args))
    for spec, old in zip(specs, before, strict=True):
        new = spec.kwargs["num_batches_tracked"]  # (max_steps,): the rows of the call's steps count one batch more
        assert (new >= old).all() and (new > old).any()


if __name__ == "__main__":
    run_table()
