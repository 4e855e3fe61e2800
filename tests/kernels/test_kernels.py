"""The compiled kernels (seqnorm.kernels, seqnorm/csrc): routed where the norms declare them, equal to the plain
reference paths, and a clean fallback when they are not built.

``tests/layers/test_fast_path.py`` runs every fast-path comparison with the kernels on and off (lengths, both
directions, two layers, initial states, steps beyond ``max_steps``, dropout, packed input, batch size 1, the
small-batch fallback); here: the plan, the generation step, gradcheck, float32, counters, and the build and fallback
machinery.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd import gradcheck
from torch.testing import assert_close

import seqnorm
from seqnorm import kernels
from seqnorm.kernels import cpu
from seqnorm.layers import stepping
from seqnorm.layers.plan import declared
from seqnorm.norms.specs import BatchNormSpec, BatchRenormSpec, WeightNormSpec
from tests.conftest import LAYERS, TORCH_KINDS, perturb_norm_parameters, require_kernels, with_spec

NORMALIZED = ["layer", "rms", "batch", "batch_renorm"]
RENORM_ACTIVE = {"warmup": 0, "r_max_steps": 1, "d_max_steps": 1, "r_max": 1.5, "d_max": 0.5}


@pytest.fixture(autouse=True)
def _built() -> None:
    require_kernels()


def _options(norm: str, **kwargs: Any) -> dict[str, Any]:
    return with_spec(norm, **({"norm_options": RENORM_ACTIVE, **kwargs} if norm == "batch_renorm" else kwargs))


def _pair(
    kind: str, norm: str, dtype: torch.dtype = torch.float64, hidden_size: int = 5, **kwargs: Any
) -> tuple[Any, Any]:
    """The reference loop and the default layer (compiled kernels), same weights, perturbed norm parameters."""
    options = _options(norm, **kwargs)
    reference = LAYERS[kind](3, hidden_size, impl="reference", dtype=dtype, **options)
    perturb_norm_parameters(reference)
    compiled = LAYERS[kind](3, hidden_size, dtype=dtype, **options)
    compiled.load_state_dict(reference.state_dict())
    return reference, compiled


@pytest.mark.parametrize("norm", NORMALIZED)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_plan_routes_normalized_layers_to_the_kernels(kind: str, norm: str) -> None:
    layer = LAYERS[kind](3, 5, num_layers=2, bidirectional=True, norm=norm)
    x = torch.randn(4, 3, 3)
    assert layer.plan(x).path == "kernel"
    assert set(layer.plan(x).cells) == {"kernel"}
    with torch.no_grad():
        assert layer.plan(x).path == "kernel"  # the forward without a gradient too (evaluation)
    layer.eval()
    with torch.no_grad():
        step = LAYERS[kind](3, 5, num_layers=2, norm=norm).eval().plan(x[0])
    assert step.path == "lean_step" and set(step.cells) == {"kernel"}
    with kernels.disabled():
        assert layer.plan(x).path == "loop"  # the plain-PyTorch fallback: the loop over the cell's step
    with torch.no_grad(), kernels.disabled():
        assert LAYERS[kind](3, 5, norm=norm).eval().plan(x[0]).cells == ("lean_step",)
    assert LAYERS[kind](3, 5).plan(x).path == "torch_kernel"  # nothing normalized: torch's own kernel


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"norm": BatchRenormSpec(beyond_max_steps="pooled")}, "pooled statistics"),
        ({"norm": WeightNormSpec(mean_only_bn=True)}, "mean-only BatchNorm"),
        ({"norm": "layer", "recurrent_dropout": 0.1}, "variational recurrent dropout"),
    ],
)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_what_the_kernels_do_not_cover_keeps_the_loop(kind: str, options: dict[str, Any], why: str) -> None:
    x = torch.randn(4, 3, 3, requires_grad=True)
    layer = LAYERS[kind](3, 5, **options)
    plan = layer.plan(x)
    assert plan.path == "loop" and why in str(plan), plan
    output, _ = layer(x)
    output.sum().backward()  # autograd through the cell's step
    assert x.grad is not None


def test_a_projection_or_another_norm_placement_keeps_the_loop() -> None:
    x = torch.randn(4, 3, 3)
    projected = seqnorm.LSTM(3, 5, norm="layer", proj_size=2)
    assert projected.plan(x).path == "loop" and "a projection" in str(projected.plan(x))
    for name, value in (("norm_placement", "joint"), ("state_norm", "carried")):
        layer = seqnorm.LSTM(3, 5, norm="layer")
        setattr(layer.cells[0], name, value)
        assert layer.plan(x).path == "loop" and "norm_placement/state_norm" in str(layer.plan(x))


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_what_the_kernels_do_not_cover_keeps_its_path(kind: str) -> None:
    x = torch.randn(4, 3, 3)
    zoneout = LAYERS[kind](3, 5, norm="layer", zoneout_h=0.1)
    assert zoneout.plan(x).path == "loop" and "zoneout" in str(zoneout.plan(x))
    half = LAYERS[kind](3, 5, norm="layer", dtype=torch.bfloat16)
    assert half.plan(x.bfloat16()).path != "kernel"


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_plan_says_where_the_input_norm_runs(kind: str) -> None:
    """An input norm that declares the kernel form runs inside the kernels; sequence-wise statistics do not (applied
    before by ``input_terms``): the plan decides it once, per direction, and the kernels' path follows it."""
    x = torch.randn(4, 3, 3)
    assert LAYERS[kind](3, 5, norm="layer", bidirectional=True).plan(x).input_norms == (True, True)
    sequence_wise = LAYERS[kind](3, 5, norm=BatchNormSpec(input_stats="sequence"))
    assert sequence_wise.plan(x).path == "kernel" and sequence_wise.plan(x).input_norms == (False,)


def test_every_norm_that_declares_the_kernel_form_says_what_it_needs() -> None:
    for name in seqnorm.NORMS:
        cell = seqnorm.LSTMCell(3, 4, norm=name)
        for module in (cell.norm_ih, cell.norm_hh, cell.norm_c):
            if module is None or "kernel" not in declared(module, "fast_forms", frozenset()):
                continue
            spec = module.kernel_norm(None)
            assert spec.kind in ("layer", "rms", "batch"), (name, spec.kind)
            assert spec.weight is module.weight and spec.eps == module.eps and spec.owner is module


def _step_both(reference: Any, compiled: Any, x: torch.Tensor, states: list[Any] | None = None) -> list[Any]:
    """Both layers' ``step()`` over the time steps of ``x`` (under no_grad), each output equal to the reference's
    (float64: 1e-12); returns both states, to go on from."""
    states = [None, None] if states is None else states
    for x_t in x.unbind(0):
        expected, states[0] = reference.step(x_t, states[0])
        got, states[1] = compiled.step(x_t, states[1])
        assert_close(got, expected, rtol=1e-12, atol=1e-12)
    return states


@pytest.mark.parametrize("norm", [*NORMALIZED, "none", "weight"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_generation_step_equals_reference(kind: str, norm: str) -> None:
    """The compiled step under no_grad: batch sizes 1 and 3, two layers, steps past max_steps (BN's last row)."""
    reference, compiled = _pair(kind, norm, num_layers=2, max_steps=3)
    reference.eval()
    compiled.eval()
    for batch in (1, 3):
        x = torch.randn(6, batch, 3, dtype=torch.float64)
        with torch.no_grad():
            assert compiled.plan(x[0]).cells == ("kernel", "kernel")
            states = _step_both(reference, compiled, x)
        assert_close(tuple(states[1]), tuple(states[0]), rtol=1e-12, atol=1e-12)


def test_switching_the_kernels_off_rebuilds_the_cached_step() -> None:
    layer = seqnorm.LSTM(3, 5, norm="layer").eval()
    x = torch.randn(2, 3)
    with torch.no_grad():
        layer.step(x)
        assert stepping._CACHE[layer].compiled
        with kernels.disabled():
            layer.step(x)
            assert not stepping._CACHE[layer].compiled  # rebuilt: the plain lean step
        layer.step(x)
        assert stepping._CACHE[layer].compiled


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_generation_step_in_training_mode_row_norms(kind: str, norm: str) -> None:
    reference, compiled = _pair(kind, norm)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        _step_both(reference, compiled, x)


@pytest.mark.parametrize(("norm", "training"), [("layer", True), ("rms", True), ("batch", True), ("batch", False)])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_gradcheck_through_the_kernels(kind: str, norm: str, training: bool) -> None:
    """Finite differences through the C++ backward (input and initial state), with a padded row."""
    torch.manual_seed(0)
    layer = LAYERS[kind](2, 3, norm=norm, dtype=torch.float64).train(training)
    perturb_norm_parameters(layer)
    x = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    hx: Any = (h0, torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)) if kind == "lstm" else h0
    lengths = torch.tensor([4, 3, 4])  # >= 2 real rows at every step
    assert layer.plan(x, lengths=lengths).path == "kernel"

    def run(x: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output, final = layer(x, tuple(states) if kind == "lstm" else states[0], lengths=lengths)
        return (output, *(final if isinstance(final, tuple) else (final,)))

    # The parameters' gradients are compared with the reference's at 1e-9 in tests/layers/test_fast_path.py.
    assert gradcheck(run, (x, *(hx if isinstance(hx, tuple) else (hx,))), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("norm", NORMALIZED)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_float32_is_as_accurate_as_the_reference(kind: str, norm: str) -> None:
    """float32 over 60 steps, both paths against the float64 result: the kernels' vectorized exp/tanh and sums, and
    whichever matmul route was measured fastest here, lose no more accuracy than the plain loop. Root-mean-square
    errors, not the largest: a recurrence amplifies rounding chaotically, so one element's error swings with the
    seed and the CPU (the loop's own largest error ranged 5e-6 to 3e-4 over 8 seeds on an AMD EPYC, where the largest
    ratio was 4.5 and the root-mean-square ratio at most 2.9 over 64 cases)."""
    exact, _ = _pair(kind, norm, num_layers=2)
    reference, compiled = _pair(kind, norm, dtype=torch.float32, num_layers=2)
    reference.load_state_dict(exact.state_dict())
    compiled.load_state_dict(exact.state_dict())
    x = torch.randn(60, 8, 3, dtype=torch.float64)
    truth, _ = exact(x)
    errors = [(layer(x.float())[0].double() - truth).square().mean().sqrt().item() for layer in (reference, compiled)]
    assert errors[1] <= 4 * errors[0] + 1e-7, errors


@pytest.mark.parametrize("norm", [*NORMALIZED, "none", "weight"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_float32_kernels_propagate_nan_like_the_reference(kind: str, norm: str) -> None:
    """A NaN in the input reaches the same outputs as on the plain path, forward and generation step alike. The
    float exp clamps its argument, which turned NaN into σ = 0 and a zero state: a finite loss that hid the NaN."""
    reference, compiled = _pair(kind, norm, dtype=torch.float32)
    x = torch.randn(5, 3, 3)
    x[1, 0, 0] = float("nan")
    x[3, 2, 1] = float("inf")
    for train in (True, False):
        expected, _ = reference.train(train)(x)
        got, _ = compiled.train(train)(x)
        assert expected[1:].isnan().any()
        assert torch.equal(got.isnan(), expected.isnan()), norm
    with torch.no_grad():
        states: list[Any] = [None, None]
        for x_t in x.unbind(0):
            expected, states[0] = reference.step(x_t, states[0])
            got, states[1] = compiled.step(x_t, states[1])
            assert torch.equal(got.isnan(), expected.isnan()), norm


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("first", "second"), [("batch", "layer"), ("layer", "batch"), ("rms", "batch_renorm")])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_row_and_batch_statistics_mixed(kind: str, first: str, second: str, threads: int) -> None:
    """A step runs a row through every norm in one pass where the norms keep statistics per row, and splits the pass
    where one's statistics span the rows. Norms of both kinds in one cell take each split, with padded rows, against
    the reference: an LSTM's cell-state norm (a GRU's recurrent norm) swapped in from a layer with the other norm."""
    swapped = "norm_c" if kind == "lstm" else "norm_hh"
    layers = []
    for impl in ("reference", "auto"):
        torch.manual_seed(0)
        layer = LAYERS[kind](3, 40, impl=impl, dtype=torch.float64, **_options(first))
        donor = LAYERS[kind](3, 40, dtype=torch.float64, **_options(second))
        setattr(layer.cells[0], swapped, getattr(donor.cells[0], swapped))
        perturb_norm_parameters(layer)
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(7, 60, 3, dtype=torch.float64)
    lengths = torch.randint(2, 8, (60,))
    lengths[:2] = 7  # >= 2 real rows at every step
    assert layers[1].plan(x, lengths=lengths).path == "kernel"
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for layer in layers:
            leaf = x.clone().requires_grad_()
            output, state = layer(leaf, lengths=lengths)
            final = state if isinstance(state, tuple) else (state,)
            loss = output.square().sum() + sum(t.square().sum() for t in final)
            results.append((output, final, torch.autograd.grad(loss, [leaf, *layer.parameters()])))
    finally:
        torch.set_num_threads(previous)
    assert_close(results[1], results[0], rtol=1e-9, atol=1e-9)
    assert_close(layers[1].state_dict(), layers[0].state_dict(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kind", "removed"),
    [
        *((kind, removed) for kind in TORCH_KINDS for removed in [(), ("norm_hh",), ("norm_ih",)]),
        ("lstm", ("norm_ih", "norm_hh")),  # the cell-state norm left (a GRU would have none: torch's kernel)
    ],
)
def test_the_recurrent_weight_gradient_is_added_a_chunk_of_steps_at_a_time(kind: str, removed: tuple[str, ...]) -> None:
    """The backward keeps the gradient of W_hh h for a chunk of about 1024 rows and adds each chunk's share of W_hh's
    gradient as it goes (WeightHhGrad): at 64 rows, chunks of 16 steps, 37 steps making three with a short last one,
    with padded rows and initial states; also without the recurrent norm or the input norm, where an LSTM keeps that
    gradient in the pre-activations' buffer (all steps without an input norm, a chunk with one)."""
    layers = []
    for impl in ("reference", "auto"):
        torch.manual_seed(0)
        layer = LAYERS[kind](3, 5, norm="layer", impl=impl, dtype=torch.float64)
        for name in removed:
            setattr(layer.cells[0], name, None)
        perturb_norm_parameters(layer)
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(37, 64, 3, dtype=torch.float64)
    lengths = torch.randint(1, 38, (64,))
    lengths[0] = 37
    h0 = torch.randn(1, 64, 5, dtype=torch.float64)
    state = (h0, torch.randn(1, 64, 5, dtype=torch.float64)) if kind == "lstm" else h0
    assert layers[1].plan(x, state, lengths=lengths).path == "kernel"
    results = []
    for layer in layers:
        leaf = x.clone().requires_grad_()
        output, final = layer(leaf, state, lengths=lengths)
        results.append((output, final, torch.autograd.grad(output.square().sum(), [leaf, *layer.parameters()])))
    assert_close(results[1], results[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_the_input_projection_s_gradients_are_computed_where_wanted(kind: str) -> None:
    """With the input norm in the kernels, the recurrence projects its input itself and its backward returns the
    gradients of x and W_ih: either alone when the other needs none (a frozen W_ih; an input without a gradient)."""
    reference, compiled = _pair(kind, "layer")
    x = torch.randn(6, 3, 3, dtype=torch.float64)
    for frozen in ("weight_ih", "x"):
        wanted = []
        for layer in (reference, compiled):
            layer.cells[0].weight_ih.requires_grad_(frozen != "weight_ih")
            leaf = x.clone().requires_grad_(frozen != "x")
            inputs = [leaf] if frozen != "x" else [layer.cells[0].weight_ih]
            wanted.append(torch.autograd.grad(layer(leaf)[0].square().sum(), [*inputs, layer.cells[0].weight_hh]))
        assert_close(wanted[1], wanted[0], rtol=1e-9, atol=1e-9)
    compiled.cells[0].weight_ih.requires_grad_(False)
    compiled(x)[0].sum().backward()
    assert compiled.cells[0].weight_ih.grad is None and compiled.cells[0].weight_hh.grad is not None


@pytest.mark.parametrize("norm", ["batch", "batch_renorm"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_batch_norm_counters_and_cumulative_average(kind: str, norm: str) -> None:
    """The padded tail's fallback steps are counted as the reference counts them; ``momentum=None`` averages."""
    reference, compiled = _pair(kind, norm, max_steps=4, momentum=None)
    x = torch.randn(7, 3, 3, dtype=torch.float64)
    lengths = torch.tensor([7, 2, 3])  # steps 3..6 have one real row: the "tail" fallback
    for _ in range(3):
        for layer in (reference, compiled):
            output, _ = layer(x, lengths=lengths)
            output.sum().backward()
    assert_close(compiled.state_dict(), reference.state_dict(), rtol=1e-12, atol=1e-12)

    def fallbacks(layer: Any) -> list[int]:
        return [m.fallback_steps for m in layer.modules() if hasattr(m, "fallback_steps")]

    assert fallbacks(compiled) == fallbacks(reference)
    assert sum(fallbacks(compiled)) > 0


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("norm", ["batch", "batch_renorm"])
def test_gru_backward_recomputes_the_batch_moments_it_did_not_keep(norm: str, fallback: bool) -> None:
    """A GRU's backward recomputes its terms from W_ih x and W_hh h, and per-timestep BN's moments from them too: the
    forward keeps none ((T, 3H) rows: only batch renormalization's r and d, 2 per norm) unless a step fell back on
    running statistics, whose buffers have changed since (then all 4 per norm). Gradients as the reference's."""
    reference, compiled = _pair("gru", norm, hidden_size=7)
    x = torch.randn(6, 4, 3, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 3, 3]) if fallback else torch.tensor([6, 4, 6, 5])  # steps 3..5: 1 real row or 2+
    moments: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) == (6, 21):  # (T, 3H): a row of statistics per step
            moments.append(1)
        return tensor

    grads = []
    for layer in (reference, compiled):
        leaf = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output, _ = layer(leaf, lengths=lengths)
        if layer is reference:
            moments.clear()
        grads.append(torch.autograd.grad(output.square().sum(), [leaf, *layer.parameters()]))
    kept = {"batch": 0, "batch_renorm": 4}[norm] + (4 if fallback else 0)
    assert len(moments) == kept
    assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-9)
    assert_close(compiled.state_dict(), reference.state_dict(), rtol=1e-12, atol=1e-12)


def test_unbuilt_kernels_warn_once_and_the_plain_path_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(tmp_path))  # an empty cache: nothing built
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # and nothing to build them with
    monkeypatch.setattr(kernels, "_LOADED", {})
    reference, layer = _pair("lstm", "layer")
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layer.plan(x).path == "loop"
        output, _ = layer(x)
        layer(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "not built" in messages[0] and "plain-PyTorch" in messages[0], messages
    assert_close(output, reference(x)[0], rtol=1e-9, atol=1e-9)
    assert kernels.status().startswith("off: the C++ kernels are not built")
    assert "no C++ compiler was found" in messages[0] and not list(tmp_path.iterdir())  # no build was tried


def test_status_before_any_layer_keeps_the_layers_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_LOADED", {})
    assert kernels.status().startswith("off: the C++ kernels are not built")  # `seqnorm --version` asks first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seqnorm.LSTM(3, 4, norm="layer")(torch.randn(2, 1, 3))
    assert [w for w in caught if issubclass(w.category, RuntimeWarning) and "not built" in str(w.message)]


def test_a_failed_build_is_recorded_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning and status say why (it told users to run the command that had just failed); the build ran with
    the interpreter's scripts folder (where pip puts ninja) on PATH; nothing partial is left."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    seen: list[str] = []

    def no_ninja(*args: Any, **kwargs: Any) -> None:
        seen.append(os.environ["PATH"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    previous = os.environ["PATH"]
    with pytest.raises(RuntimeError, match="Ninja is required"):
        kernels.build()
    assert seen[0].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert os.environ["PATH"] == previous and seen[0].endswith(os.pathsep + previous)  # restored
    assert [path.suffix for path in tmp_path.iterdir() if path.suffix != ".lock"] == [".failed"]
    assert "their last build failed: RuntimeError: Ninja is required" in kernels.status()


def test_a_build_published_meanwhile_without_the_lock_is_replaced_by_one_with_a_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that holds no lock (an older seqnorm sharing the cache) renamed a build into place while this one
    compiled: it has no manifest, so no load would take it; ours replaces it whole, and no folder is left over."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(tmp_path))
    final = kernels.cache_dir() / kernels._build_key(cpu.capability())

    def racing(name: str, sources: list[str], build_directory: str, **kwargs: Any) -> None:
        Path(build_directory, "seqnorm_kernels.so").write_text("ours")
        final.mkdir(parents=True)  # the other process renamed its build into place meanwhile
        (final / "seqnorm_kernels.so").write_text("theirs")

    monkeypatch.setattr(cpp_extension, "load", racing)
    assert kernels.build().read_text() == "ours"
    assert kernels._broken(final) is None  # whole, and as its manifest says
    left = sorted(path.name for path in tmp_path.iterdir() if path.suffix != ".lock")
    assert left == [final.name]  # our work directory and theirs are gone


def test_the_build_command_without_a_compiler(tmp_path: Path) -> None:
    """No compiler: one sentence and exit 0 (the plain path will run); ``--strict`` exits 1."""
    env = {**os.environ, "SEQNORM_KERNELS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    command = [sys.executable, "-m", "seqnorm.kernels"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "not built" in result.stdout and "plain-PyTorch path" in result.stdout
    strict = subprocess.run([*command, "--strict"], env=env, capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1
    assert not list(tmp_path.glob("*/seqnorm_kernels.so"))


@pytest.mark.parametrize("norm", NORMALIZED)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_two_threads_equal_the_reference(kind: str, norm: str) -> None:
    """With 2 threads the kernels split each step's passes between them (by rows, each thread summing the
    parameters' gradients and batch statistics' backward sums apart; by features for the batch statistics
    themselves). The suite otherwise runs on one thread (conftest)."""
    reference, compiled = _pair(kind, norm, num_layers=2, bidirectional=True, hidden_size=96)
    x = torch.randn(6, 70, 3, dtype=torch.float64)  # blocks of 70 x 288+ gates: big enough to be split
    lengths = torch.randint(2, 7, (70,))
    lengths[:2] = 6
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for layer in (reference, compiled):
            leaf = x.clone().requires_grad_()
            output, state = layer(leaf, lengths=lengths)
            final = state if isinstance(state, tuple) else (state,)
            loss = output.square().sum() + sum(t.sum() for t in final)
            results.append((output, final, torch.autograd.grad(loss, [leaf, *layer.parameters()])))
    finally:
        torch.set_num_threads(previous)
    assert_close(results[1], results[0], rtol=1e-9, atol=1e-9)
    assert_close(compiled.state_dict(), reference.state_dict(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_preparing_the_kernels_draws_nothing_from_the_generator(kind: str) -> None:
    """Measuring the per-step product's route and the generation step's weight layout runs products on operands of
    its own: a sampling loop gives the same draws whether or not a step was just prepared. (Shapes no other test
    uses, so that both measurements run here.)"""
    layer = LAYERS[kind](3, 41, norm="layer")
    x = torch.randn(5, 13, 3)
    before = torch.get_rng_state()
    layer(x)[0].sum().backward()
    layer.eval()
    with torch.no_grad():
        assert layer.plan(x[0]).path == "lean_step"
        layer.step(x[0])
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("layout", ["row-major", "view"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_generation_step_with_either_weight_layout(kind: str, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either layout of ``W^T`` the compiled step may choose (LayoutChoice) gives the reference's steps, and so do
    the steps that run on the view while the row-major copy is written a chunk at a time."""
    decided = cpu.LayoutChoice(copy_wins=layout == "row-major")
    monkeypatch.setattr(cpu.LayoutChoice, "of", classmethod(lambda cls, weight, rows: decided))
    monkeypatch.setattr(cpu._ChunkedCopy, "CHUNK", 9)  # W_ih^T (3, 20): two steps; W_hh^T (5, 20): three
    reference, compiled = _pair(kind, "layer", num_layers=2)
    reference.eval()
    compiled.eval()
    x = torch.randn(8, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        _step_both(reference, compiled, x)


def test_the_weight_layout_is_measured_on_the_steps_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    """No probe products before the first step (they paused it by 28 ms): the steps time the two layouts while they
    run, and once both weights' layouts are chosen they read no clock; a step prepared again (after a training step)
    reuses the choice, and another row count is measured anew."""
    monkeypatch.setattr(cpu, "_LAYOUTS", {})
    clock = _count_clock_reads(monkeypatch)
    reference, compiled = _pair("lstm", "layer", hidden_size=6)
    reference.eval()
    compiled.eval()
    x = torch.randn(60, 1, 3, dtype=torch.float64)  # 24 steps per weight to choose
    with torch.no_grad():
        states = _step_both(reference, compiled, x)
        choices = [cpu.LayoutChoice.of(weight, 1) for weight in (compiled.weight_ih_l0, compiled.weight_hh_l0)]
        assert all(choice.copy_wins is not None for choice in choices) and clock["reads"] > 0
        reads = clock["reads"]
        compiled.step(x[0], states[1])
        stepping.forget(compiled)  # as a training step does
        compiled.step(x[0], states[1])
        assert clock["reads"] == reads
        stepping.forget(compiled)
        compiled.step(torch.randn(2, 3, dtype=torch.float64))  # two rows: another choice, measured
        assert clock["reads"] > reads


def _count_clock_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the layout measurement's clock reads (each timed step reads it): ``{"reads": n}``, updated live."""
    clock = {"reads": 0}
    real = cpu.time.perf_counter

    def counted() -> float:
        clock["reads"] += 1
        return real()

    monkeypatch.setattr(cpu.time, "perf_counter", counted)
    return clock


@pytest.fixture
def product_route() -> Any:
    """Forces the per-step matmul's route (csrc/product.h) for one test, then lets it be measured again."""
    native = kernels.native("cpu")

    def force(route: str) -> None:
        native.set_product_route(route)

    yield force
    native.set_product_route("auto")


def test_the_product_route_is_measured_and_can_be_forced(product_route: Any) -> None:
    native = kernels.native("cpu")
    weight = torch.randn(148, 37)
    routes = {"blas"} | ({"brgemm"} if native.brgemm_available() else set())
    assert native.product_route(weight, 70) in routes | {"packed"}
    assert native.product_route(weight.double(), 70) == "blas"  # float64: at::mm only
    for route in routes:
        product_route(route)
        assert native.product_route(weight, 70) == route
    product_route("packed")
    assert native.product_route(weight, 1) in {"blas", "brgemm"}  # one row is never packed
    assert native.product_route(weight, 1) in routes | {"gemv"}
    product_route("gemv")
    assert native.product_route(weight, 1) == "gemv"
    assert native.product_route(weight, 70) == "blas"  # more than one row: never the matrix-vector product
    with pytest.raises(ValueError, match="expected auto, brgemm, packed, blas or gemv"):
        native.set_product_route("fast")


def test_the_product_route_is_measured_on_the_recurrence_s_own_products() -> None:
    """No probe products before a new shape's first call (they paused it by 30-40 ms): its products take the
    candidate routes in turn, timed, and choose the route once each has its rounds (36 products for three routes),
    across calls if one is too short. Meanwhile, routes mixed within a call, outputs and gradients are as accurate
    as the plain loop's in float32 (root-mean-square error against float64, as in the test above)."""
    native = kernels.native("cpu")
    rows, hidden = 41, 23  # a shape no other test multiplies
    threads = torch.get_num_threads()
    forward_key, backward_key = (rows, hidden, 4 * hidden, threads), (rows, 4 * hidden, hidden, threads)

    def chosen() -> set[tuple[int, ...]]:
        return {key[:4] for key in native.chosen_routes()}

    assert not chosen() & {forward_key, backward_key}
    exact, _ = _pair("lstm", "layer", hidden_size=hidden)
    reference, compiled = (LAYERS["lstm"](3, hidden, norm="layer", impl=impl) for impl in ("reference", "auto"))
    for layer in (reference, compiled):
        layer.load_state_dict(exact.state_dict())
    for steps in (4, 4, 30):  # 4 + 4 products of each shape: not yet chosen; then the rest within the third call
        x = torch.randn(steps, rows, 3, dtype=torch.float64)
        results = []
        for layer in (exact, reference, compiled):
            leaf = x.clone().to(next(layer.parameters()).dtype).requires_grad_()
            output, _ = layer(leaf)
            results.append([output, *torch.autograd.grad(output.square().sum(), [leaf, *layer.parameters()])])
        for truth, plain, ours in zip(*results, strict=True):
            errors = [(got.double() - truth).square().mean().sqrt().item() for got in (plain, ours)]
            assert errors[1] <= 4 * errors[0] + 1e-6, errors
        if steps == 4 and len(native.product_candidates(rows)) > 1:
            assert not chosen() & {forward_key, backward_key}
    assert {forward_key, backward_key} <= chosen()


def test_trials_run_blocks_in_rotating_rounds_and_compare_each_block_s_fastest_timed_run_within_its_round() -> None:
    """The one rule behind the product routes and the generation layouts (product.h's Trials)."""
    native = kernels.native("cpu")
    trials = native.Trials(3)
    block, rounds = trials.block, trials.rounds
    # Per round, each candidate's fastest time in its block; every block's first run (the switch) takes 1000 and is
    # not timed, its second 3x the fastest (still settling). The rounds slow down 10x each, as a trial's first calls
    # do the other way: candidate 1 has the lowest median time (10) but is never the fastest in its round; candidate
    # 0 is the fastest in two rounds of three.
    seconds = [{0: 1.0, 1: 1.1, 2: 2.0}, {0: 10.0, 1: 11.0, 2: 20.0}, {0: 900.0, 1: 10.0, 2: 20.0}]
    turns = []
    while trials.chosen is None:
        turn = trials.turn()
        fastest, position = seconds[len(turns) // (3 * block)][turn], len(turns) % block
        trials.record(turn, 1000.0 if position == 0 else 3 * fastest if position == 1 else fastest)
        turns.append(turn)
    order = [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # round r starts with candidate r mod 3
    assert turns == [candidate for r in range(rounds) for candidate in order[r % 3] for _ in range(block)]
    assert trials.chosen == 0  # ratios to the round's fastest: 1, 1, 90 (median 1) against 1.1, 1.1, 1 (1.1)
    trials.record(2, 0.0)  # decided: later runs change nothing
    assert trials.chosen == 0

    tied = native.Trials(2)
    for _ in range(rounds * 2 * block):
        tied.record(tied.turn(), 1.0)
    assert tied.chosen == 0  # the first on a tie

    overlapping = native.Trials(2)  # runs recorded against another candidate's turn (a shared Trials)
    for _ in range(2 * block):
        overlapping.record(0, 1.0)  # round 0: no timed run of candidate 1, so the round does not count
    for _ in range(rounds * 2 * block):
        overlapping.record(overlapping.turn(), 1.0 if overlapping.turn() == 1 else 2.0)
        if _ < (rounds - 1) * 2 * block:
            assert overlapping.chosen is None
    assert overlapping.chosen == 1

    for bad in (2, -1):  # -1 was pybind's many-line "incompatible function arguments" TypeError
        with pytest.raises(ValueError, match=f"^Trials: expected a candidate from 0 to 1, got {bad}$"):
            tied.record(bad, 1.0)
    for bad, shown in ((math.nan, "nan"), (math.inf, "inf"), (-1.0, "-1")):  # taken before, deciding at random
        with pytest.raises(ValueError, match=f"Trials: expected seconds to be a finite number >= 0, got {shown}$"):
            native.Trials(2).record(0, bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"^Trials: expected at least one candidate, got {bad}$"):
            native.Trials(bad)


def test_deterministic_algorithms_fix_the_route_and_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured choices depend on the machine's load, and each route rounds differently: with deterministic
    algorithms a seeded run gives the same numbers in every process (the experiment scripts rely on it)."""
    native = kernels.native("cpu")
    clock = _count_clock_reads(monkeypatch)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for rows in (1, 16, 64):
            route = native.product_route(torch.randn(256, 1024), rows)
            expected = {"brgemm"} if native.brgemm_available() else ({"packed", "blas"} if rows >= 8 else {"blas"})
            assert route in expected and native.product_route(torch.randn(256, 1024), rows) == route
        assert cpu.LayoutChoice.of(torch.randn(20, 7), 5).copy_wins is False  # the view, chosen unmeasured
        compiled = _pair("gru", "layer", dtype=torch.float32)[1].eval()
        with torch.no_grad():
            compiled.step(torch.randn(5, 3))
        assert clock["reads"] == 0
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_input_projection_s_layout_is_measured_on_the_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrence's input projection multiplies by a row-major copy of W^T or by the transposed view, whichever
    its own calls measured faster (kernels' Trials: 24 calls); either gives the same product. With deterministic
    algorithms it is the copy, as it always was, and nothing is timed."""
    monkeypatch.setattr(cpu, "_PROJECTION_LAYOUTS", {})
    monkeypatch.setattr(cpu, "_PROJECTION_TRIALS", {})
    native = kernels.native("cpu")
    x, weight = torch.randn(7, 3, 5), torch.randn(12, 5)
    block, rounds = native.Trials(2).block, native.Trials(2).rounds
    for _ in range(2 * block * rounds):
        assert_close(native.project_kept(x, weight, torch.empty(7, 3, 12)), x @ weight.t())
    [choice] = cpu._PROJECTION_LAYOUTS.values()
    assert choice.copy_wins is not None and not cpu._PROJECTION_TRIALS
    clock = _count_clock_reads(monkeypatch)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert cpu.ProjectionLayout.of(weight, 21).copy_wins is True
        assert_close(native.project_kept(x, weight, torch.empty(7, 3, 12)), x @ weight.t())
        assert clock["reads"] == 0
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("route", ["brgemm", "packed", "blas"])
@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_every_product_route_equals_the_reference(kind: str, norm: str, route: str, product_route: Any) -> None:
    """Each route of the per-step matmul in float32 (70 rows: more than one micro-kernel's block; 37 hidden units:
    column blocks that do not divide evenly; lengths: padded rows), forward and gradients against the plain loop."""
    native = kernels.native("cpu")
    if route == "brgemm" and not native.brgemm_available():
        pytest.skip("oneDNN's float32 brgemm does not run here")
    product_route(route)
    reference, compiled = _pair(kind, norm, dtype=torch.float32, hidden_size=37)
    x = torch.randn(5, 70, 3)
    lengths = torch.randint(1, 6, (70,))
    lengths[0] = 5
    results = []
    for layer in (reference, compiled):
        leaf = x.clone().requires_grad_()
        output, _ = layer(leaf, lengths=lengths)
        results.append((output, torch.autograd.grad(output.square().sum(), [leaf, *layer.parameters()])))
    assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm", ["none", "layer", "rms"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
@pytest.mark.parametrize("hidden_size", [37, 128])
def test_the_matrix_vector_route_equals_the_reference(
    kind: str, norm: str, hidden_size: int, product_route: Any
) -> None:
    """Batch size 1 on the gemv route (product.h): the forward's dot products with W_hh's rows, read in place, and
    the backward's pass over W_hh's rows; 37 hidden units leave partial vectors and column blocks, 128 split the
    columns between threads where there are several."""
    product_route("gemv")
    reference, compiled = _pair(kind, norm, dtype=torch.float32, hidden_size=hidden_size)
    x = torch.randn(6, 1, 3)
    results = []
    for layer in (reference, compiled):
        leaf = x.clone().requires_grad_()
        output, _ = layer(leaf)
        results.append((output, torch.autograd.grad(output.square().sum(), [leaf, *layer.parameters()])))
    assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous tensor: every other element of a wider buffer, or column-major."""
    if tensor.dim() == 1:
        wide = torch.full((tensor.shape[0], 2), 1e6, dtype=tensor.dtype)
        wide[:, 0] = tensor
        return wide[:, 0]
    return tensor.t().contiguous().t()


@pytest.mark.parametrize("norm", NORMALIZED)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_strided_parameters_and_buffers_give_the_reference_numbers(kind: str, norm: str) -> None:
    # load_state_dict(assign=True) keeps the state dict's own tensors: strided gains, biases and running statistics
    # were read as dense rows (outputs 1.6 off; BN training wrote its running statistics into the wrong elements)
    reference, compiled = _pair(kind, norm)
    state = {
        # (clones: with assign=True the layer would otherwise share the reference's other tensors)
        name: _strided(tensor) if tensor.is_floating_point() and ("norm_" in name or "bias" in name) else tensor.clone()
        for name, tensor in reference.state_dict().items()
    }
    assert any(not tensor.is_contiguous() for tensor in state.values())
    compiled.load_state_dict(state, assign=True)
    x = torch.randn(4, 3, 3, dtype=torch.float64)
    for training in (True, False):
        reference.train(training), compiled.train(training)
        output, expected = compiled(x)[0], reference(x)[0]
        assert_close(output, expected)
        for name, buffer in reference.named_buffers():
            assert_close(dict(compiled.named_buffers())[name], buffer, msg=name)
        # and the gradients (BN's fallback from the kernels read a strided gain as dense rows: 1e17 off)
        grads = torch.autograd.grad(output.square().sum(), list(compiled.parameters()))
        wanted = torch.autograd.grad(expected.square().sum(), list(reference.parameters()))
        for grad, want in zip(grads, wanted, strict=True):
            assert_close(grad, want)
    expanded = LAYERS[kind](3, 33, norm=norm, dtype=torch.float64)  # a gain of one stored element, stride 0
    gain = torch.full((1,), 0.7, dtype=torch.float64).expand(expanded.cells[0].norm_hh.weight.shape[0])
    expanded.load_state_dict({"norm_hh_l0.weight": gain}, strict=False, assign=True)
    plain = LAYERS[kind](3, 33, norm=norm, impl="reference", dtype=torch.float64)
    plain.load_state_dict(expanded.state_dict())
    x = torch.randn(4, 3, 3, dtype=torch.float64)
    assert expanded.plan(x).path == "kernel"
    assert_close(expanded(x)[0], plain(x)[0])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_a_row_norms_step_through_the_norm_step_node_equals_torch(kind: str) -> None:
    """The norm_step binding (one norm's step as an autograd node made in C++) takes any norm the kernels have
    (per-timestep BN's cell step is its caller): LayerNorm and RMSNorm over a masked step equal torch's, the padded
    rows getting no gradient and adding nothing to γ's and the shift's (float64)."""
    require_kernels()
    native = kernels.native("cpu")
    torch.manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(7, dtype=torch.float64) + 0.5).requires_grad_()
    shift = torch.randn(7, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False])
    dy = torch.randn(5, 7, dtype=torch.float64)
    args = kernels.KernelNorm(kind, 1e-5, weight, shift).native(native)
    y = native.norm_step(x, weight, shift, mask, args, 0, None)
    assert y.grad_fn.name() == "NormStepBackward"
    got = torch.autograd.grad((y * dy).sum(), (x, weight, shift))
    if kind == "layer":
        expected = torch.nn.functional.layer_norm(x, (7,), weight, shift, 1e-5)
    else:
        expected = x * torch.rsqrt(x.square().mean(1, keepdim=True) + 1e-5) * weight + shift
    grads = torch.autograd.grad((expected * dy * mask.unsqueeze(1)).sum(), (x, weight, shift))
    assert_close(y, expected)
    assert_close(list(got), list(grads))
