# The two commands of the README: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that lies on this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast lint venv kernels clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[train,test]"
	touch $@

# The compiled kernels (seqnorm/csrc), built once per machine into ~/.cache/seqnorm/kernels (python -m seqnorm.kernels):
# here, so that neither the demo nor the tests pay the build (a layer would build them on first use). Without a compiler
# it says so and the plain path runs.
$(BIN)/.kernels: $(BIN)/.installed $(wildcard seqnorm/csrc/*) seqnorm/kernels/builder.py seqnorm/kernels/cpu.py
	$(BIN)/python -m seqnorm.kernels
	touch $@

# The highest Triton the [gpu] extra allows, beside the venv's lowest ([test]'s pin): 3.9's interpreter refused masks
# that 3.6's took, so tests/kernels/test_triton_backend.py runs under both (tests/test_packaging.py checks that these two are
# the ends of the declared range). Its own folder, first on PYTHONPATH for that run only (about 1 GB, once).
TRITON_HIGHEST := 3.9.0
HIGHEST := $(VENV)/triton-$(TRITON_HIGHEST)

$(HIGHEST)/.installed: | $(BIN)/.installed
	rm -rf $(HIGHEST)
	$(BIN)/python -m pip install --quiet --no-deps --target $(HIGHEST) "triton==$(TRITON_HIGHEST)"
	touch $@

venv: $(BIN)/.installed $(BIN)/.kernels

kernels: $(BIN)/.kernels

# The whole suite, on up to 4 worker processes (pytest-xdist, idle workers stealing queued tests), ending with its 15
# slowest tests: the place to look when it grows. Beside it, in one more process whose output follows the suite's,
# the Triton backend's tests again under the highest Triton, for what differs between Triton versions: that every
# kernel runs in that interpreter (each against the plain path in float64, two bidirectional layers with lengths:
# masked lanes and rows) and that every launched specialization builds for a GPU with that compiler. The other cases
# (gradchecks, float32, batch 1, odd sizes, and two of the four bf16 step-product cases) check the kernels' numbers case
# by case; they run under the lowest, in the suite (all passed under 3.9.0 too, last on 2026-11-29). ~5 minutes on 2
# idle cores; fails if either fails.
HIGHEST_TESTS := tests/kernels/test_triton_backend.py \
	-k "not gradcheck and not float32 and not batch-1 and not odd-sizes and not lstm-batch-bf and not gru-layer-bf"

test: venv $(HIGHEST)/.installed
	$(BIN)/python -m ruff check seqnorm tests scripts examples
	PYTHONPATH=$(HIGHEST) $(BIN)/python -c 'import triton; assert triton.__version__ == "$(TRITON_HIGHEST)", triton.__file__'
	PYTHONPATH=$(HIGHEST) $(BIN)/python -m pytest -p no:cacheprovider $(HIGHEST_TESTS) \
		> $(VENV)/triton-highest.log 2>&1 & highest=$$!; \
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist worksteal --durations 15; suite=$$?; \
	wait $$highest; passed=$$?; \
	echo "--- the Triton backend under triton $(TRITON_HIGHEST):"; tail -n 25 $(VENV)/triton-highest.log; \
	test $$suite -eq 0 && test $$passed -eq 0

# The inner loop: the suite without the tests marked slow (processes, CLI runs, end-to-end training, the Triton
# interpreter; tests/conftest.py): about a minute on 2 idle cores (50 s on an AMD EPYC, 2026-11-29).
test-fast: venv
	$(BIN)/python -m pytest -n auto --maxprocesses 4 -m "not slow"

lint: venv
	$(BIN)/python -m ruff check seqnorm tests scripts examples
	$(BIN)/python -m ruff format --check seqnorm tests scripts examples

demo: venv
	$(BIN)/python scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: bench bench-targets bench-gpu
# Speed and memory against torch.nn's fused LSTM/GRU (Markdown tables for BENCHMARKS.md); ARGS=--quick for a short run.
bench: venv
	$(BIN)/python scripts/bench.py $(ARGS)

# Issue 14's targets over three fresh processes of bench.py, side by side (Markdown for BENCHMARKS.md); ARGS as for
# scripts/bench_targets.py (--processes 4, --repeats 9, or bench.py's own options).
bench-targets: venv
	$(BIN)/python scripts/bench_targets.py $(ARGS)

# The Triton backend on a CUDA GPU against cuDNN (scripts/bench_gpu.py; needs only torch and triton: on a machine
# without the venv, `PYTHONPATH=. python3 scripts/bench_gpu.py`). Without CUDA it says so and exits 0.
bench-gpu:
	PYTHONPATH=.$(if $(wildcard build/flashrnn),:build/flashrnn) \
		$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/bench_gpu.py $(ARGS)

# FlashRNN and einops (pure Python wheels) unpacked for bench-gpu's comparison rows, for a GPU machine without the
# package index: carry build/flashrnn there.
build/flashrnn: venv
	$(BIN)/python -m pip download --no-deps --dest $@ flashrnn einops
	cd $@ && for wheel in *.whl; do ../../$(BIN)/python -m zipfile -e $$wheel . ; done
