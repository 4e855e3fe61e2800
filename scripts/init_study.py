"""Hidden-state and gradient scale through time at initialization, for every init scheme x norm (no training).

The "untamed variance" argument of the initialization literature (Glorot & Bengio 2010, Saxe et al. 2014), made
recurrent: an untrained layer is run over T steps of unit-variance noise, and at every step we measure the spread
of ``h`` (and of the LSTM cell state ``c``, which no gate bounds), how many gates sit saturated, and the size of the
gradient that a loss on the last state sends back to each earlier ``h_t``. The ratio of the gradient at step 0 to
the one at step T-1 shows vanishing (far below 1) or exploding (far above 1) through time. Layers run in training
mode, so per-timestep BN normalizes with batch statistics, as it does when training starts. Measurements are taken
through the cells' documented ``observer`` hooks. Nothing is trained, so the fair protocol of the other scripts
(``_protocol``: a learning-rate grid and seeds) has no rate to choose; ``--seeds`` averages independent
initializations.

    python scripts/init_study.py --quick     # T = 50, one seed, seconds
    python scripts/init_study.py --steps 200 --seeds 5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import torch

import seqnorm

NAME = "init_study"
QUICK = {"steps": 50, "batch_size": 32, "hidden": 64, "input_size": 32, "seeds": 1}
FULL = {"steps": 200, "batch_size": 32, "hidden": 128, "input_size": 64, "seeds": 3}
SATURATED = 0.05  # a sigmoid gate below 0.05 or above 0.95 passes (almost) no gradient


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, NAME, text=False)  # its inputs are N(0, 1) noise, not text
    parser.add_argument("--norms", nargs="+", choices=list(seqnorm.NORMS), default=list(seqnorm.NORMS))
    parser.add_argument("--inits", nargs="+", choices=list(seqnorm.INITS), default=list(seqnorm.INITS))
    parser.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
    parser.add_argument("--steps", type=_common.positive_int, help="T: time steps")
    parser.add_argument("--batch-size", type=_common.positive_int)
    parser.add_argument("--hidden", type=_common.positive_int)
    parser.add_argument("--input-size", type=_common.positive_int)
    parser.add_argument("--seeds", type=_common.positive_int, help="independent initializations averaged per cell")
    return _common.resolve(parser.parse_args(argv), QUICK, FULL)


def profile(args: argparse.Namespace, init: str, norm: str, seed: int) -> dict[str, torch.Tensor]:
    """Per-step ``h_std``, ``c_std``, ``saturation`` and ``grad_rms`` ``(T,)`` of one freshly initialized layer."""
    torch.manual_seed(seed)
    layer_class = seqnorm.LSTM if args.cell == "lstm" else seqnorm.GRU
    # float64: gradients that vanish through 200 steps reach 1e-30 and below, which float32 flushes to zero.
    # The same forget-gate bias for every norm (--forget-bias), as the training scripts: a saturated forget gate
    # changes how far the gradient reaches back, which would otherwise be credited to the norm.
    same_bias = args.cell == "lstm" and args.forget_bias != _common.LIBRARY_FORGET_BIAS
    extra = {"forget_bias": args.forget_bias} if same_bias else {}
    layer = layer_class(
        args.input_size, args.hidden, norm=norm, init=init, max_steps=args.steps, dtype=torch.float64, **extra
    )
    layer.train()
    records: list[dict[str, Any]] = []

    def keep(module: torch.nn.Module, inputs: tuple[dict[str, Any]], output: None) -> None:
        record = inputs[0]
        record["h"].retain_grad()  # dL/dh_t through the recurrence, read after backward
        records.append(record)

    handle = layer.cells[0].observer.register_forward_hook(keep)
    try:
        x = torch.randn(args.steps, args.batch_size, args.input_size, dtype=torch.float64)  # (T, B, I)
        output, _ = layer(x)
        readout = torch.randn(args.hidden, dtype=torch.float64) / math.sqrt(args.hidden)
        (output[-1] @ readout).sum().backward()
    finally:
        handle.remove()
    gates_per_block = args.hidden
    sigmoid_blocks = [0, 1, 3] if args.cell == "lstm" else [0, 1]  # i, f, o / r, z: the sigmoid gates
    saturation = []
    for record in records:
        gates = record["gates"].detach()
        sigmoids = torch.cat([gates[:, b * gates_per_block : (b + 1) * gates_per_block] for b in sigmoid_blocks], 1)
        saturation.append(((sigmoids < SATURATED) | (sigmoids > 1 - SATURATED)).float().mean())
    result = {
        "h_std": torch.stack([r["h"].detach().std() for r in records]),
        "grad_rms": torch.stack([r["h"].grad.pow(2).mean().sqrt() for r in records]),
        "saturation": torch.stack(saturation),
    }
    if args.cell == "lstm":
        result["c_std"] = torch.stack([r["c"].detach().std() for r in records])
    return result


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = _common.RunLog(argv, NAME)
    args = parse_args(argv)
    rows, curves = [], {}
    for norm in args.norms:
        for init in args.inits:
            row: dict[str, Any] = {"init": init, "norm": norm, "status": "ok"}
            try:
                profiles = [profile(args, init, norm, args.seed + k) for k in range(args.seeds)]
            except ValueError as error:
                row["status"] = _common.describe_error(error)
                rows.append(row)
                continue
            mean = {key: torch.stack([p[key] for p in profiles]).mean(0) for key in profiles[0]}
            curves[(norm, init)] = mean
            grad = mean["grad_rms"]
            row.update(
                h_std_first=float(mean["h_std"][0]),
                h_std_last=float(mean["h_std"][-1]),
                c_std_last=float(mean["c_std"][-1]) if "c_std" in mean else None,
                saturated_last=float(mean["saturation"][-1]),
                grad_first=float(grad[0]),
                grad_last=float(grad[-1]),
                log10_grad_ratio=math.log10(max(float(grad[0]), 1e-300) / float(grad[-1])),
            )
            rows.append(row)
    columns = [
        "init",
        "norm",
        "status",
        "h_std_first",
        "h_std_last",
        "c_std_last",
        "saturated_last",
        "grad_first",
        "grad_last",
        "log10_grad_ratio",
    ]
    notes = [
        f"{args.cell.upper()}, hidden {args.hidden}, input {args.input_size} (N(0, 1) noise), T = {args.steps}, batch "
        f"{args.batch_size}, mean of {args.seeds} seed(s); training mode, float64; "
        f"{_common.forget_bias_text(args) if args.cell == 'lstm' else 'no forget gate'}. h_std/c_std: std over "
        "batch and units at the first / last step; saturated_last: share of sigmoid gates outside [0.05, 0.95] at "
        "the last step.",
        "grad_first / grad_last: RMS of dL/dh_t at t = 0 and t = T-1 for L = <h_T, r> with a random unit-scale r; "
        "log10_grad_ratio = log10(grad_first / grad_last): 0 means the gradient reaches the first step at full "
        "size, -2 means it arrives 100x smaller.",
    ]
    _common.write_results(args.out, rows, columns, title=f"Variance through time at init (T={args.steps})", run=run,
                          notes=notes)  # fmt: skip
    plot(curves, args, args.out / "variance_through_time.png")
    return rows


def plot(curves: dict[tuple[str, str], dict[str, torch.Tensor]], args: argparse.Namespace, path: Path) -> None:
    plt = _common.pyplot()
    norms = list(dict.fromkeys(norm for norm, _ in curves))
    if not norms:
        return
    figure, axes = plt.subplots(2, len(norms), figsize=(2.6 * len(norms) + 1, 5), dpi=80, squeeze=False)
    for column, norm in enumerate(norms):
        for (curve_norm, init), curve in curves.items():
            if curve_norm != norm:
                continue
            axes[0][column].plot(curve["c_std" if "c_std" in curve else "h_std"].numpy(), label=init, linewidth=1)
            axes[1][column].semilogy(curve["grad_rms"].numpy(), label=init, linewidth=1)
        axes[0][column].set_title(f"norm={norm}", fontsize=9)
        axes[1][column].set_xlabel("step t", fontsize=8)
    axes[0][0].set_ylabel("c std" if args.cell == "lstm" else "h std", fontsize=8)
    axes[1][0].set_ylabel("RMS dL/dh_t", fontsize=8)
    axes[0][0].legend(fontsize=7)
    for axis in axes.flat:
        axis.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


if __name__ == "__main__":
    main()
