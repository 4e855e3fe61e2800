"""The compiled kernels' per-step matmul routes, A/B on whole training steps (issue 14).

The kernels' per-step product (``seqnorm/csrc/product.h``) runs oneDNN's brgemm, MKL's packed GEMM or ``at::mm``,
in float32 whichever was measured fastest for the shape. This script forces each route in turn, interleaved with
``torch.nn.LSTM``/``GRU`` on the same input (``bench.py``'s rounds), and prints each route's ratio to torch's layer
beside the route the measurement picks, so that a machine where the choice is wrong shows it.

Usage: ``python scripts/bench_routes.py --sizes 100x32x128x256,100x64x256x512 --norms layer,batch --repeats 7``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import date
from typing import Any

import torch
from bench import LAYERS, TORCH_LAYERS, ab_arguments, cpu_name, interleaved, parse_sizes, ratio, training_step

import seqnorm

ROUTES = ("brgemm", "packed", "blas")


def forced(native: Any, route: str, run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with the per-step product forced onto ``route`` (then measured again)."""

    def with_route() -> None:
        native.set_product_route(route)
        try:
            run()
        finally:
            native.set_product_route("auto")

    return with_route


def main() -> None:
    args = ab_arguments(__doc__.splitlines()[0], cells="lstm", norms="layer,batch", repeats=7)
    native = seqnorm.kernels.native("cpu")
    if native is None:
        raise SystemExit(f"bench_routes.py: expected the compiled kernels, got: {seqnorm.kernels.status()}")
    print(f"{cpu_name()}; torch {torch.__version__}, {args.threads} threads; {date.today()}; median (lowest–highest)")
    print(f"of {args.repeats} interleaved rounds' ratios to torch's layer; training input ", end="")
    print(f"{'with' if args.input_grad else 'without'} gradient\n")
    print("| size, norm | torch ms | " + " | ".join(ROUTES) + " | measured choice (forward; backward) |")
    print("|---|---:|" + "---:|" * len(ROUTES) + "---|")
    for steps, batch, input_size, hidden in parse_sizes(args.sizes):
        x = torch.randn(steps, batch, input_size).requires_grad_(args.input_grad)
        for kind in args.cells.split(","):
            gates = {"lstm": 4, "gru": 3}[kind]
            for norm in args.norms.split(","):
                torch.manual_seed(0)
                layer = LAYERS[kind](input_size, hidden, norm=norm)
                variants = {"torch": training_step(TORCH_LAYERS[kind](input_size, hidden), x)}
                variants.update({route: forced(native, route, training_step(layer, x)) for route in ROUTES})
                times = interleaved(variants, args.repeats)
                torch_ms = 1e3 * sorted(times["torch"])[len(times["torch"]) // 2]
                chosen = (
                    native.product_route(torch.empty(hidden, gates * hidden), batch),
                    native.product_route(torch.empty(gates * hidden, hidden), batch),
                )
                cells = " | ".join(ratio(times, route, "torch") for route in ROUTES)
                name = f"{kind} {steps}x{batch}x{input_size}x{hidden}, {norm}"
                print(f"| {name} | {torch_ms:.1f} | {cells} | {chosen[0]}; {chosen[1]} |")


if __name__ == "__main__":
    main()
