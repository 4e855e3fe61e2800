"""Two runs of ``batch_size_sweep.py`` that differ in one thing (the *arms*: random against bucketed batches, say),
compared on what each measures against its own plain LSTM.

For every norm and batch size both arms ran, at each arm's chosen rate: the paired per-seed difference from the plain
LSTM of the same arm and batch size (``diff_vs_none``, as the sweep prints it), and how much that difference moved
from the first arm to the second (``change``: the per-seed difference of those differences, with its 95% interval
and the seeds where its sign held; the seeds are the same initializations in both arms). Per-timestep BN is compared
on its exact statistics where the sweep chose its rate on them, and its single-row tail steps per update are shown
for both arms. Reads each arm's ``results.csv`` and ``trials.csv``; trains nothing.

    python scripts/compare_arms.py docs/results/tail_effect/random docs/results/tail_effect/bucketed \\
        --names random bucketed --out docs/results/tail_effect
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import _common
import _protocol

Key = tuple[str, int]

RESULTS_COLUMNS = ("norm", "batch_size", "status", "lr")
"""The columns of an arm's ``results.csv`` that are read (``lr_chosen_on`` too, where there)."""
TRIALS_COLUMNS = ("norm", "batch_size", "lr", "seed", "status", "val_bpc")
"""The columns of an arm's ``trials.csv`` that are read (``val_bpc_exact`` and ``fallback_per_update`` too, where
there)."""


def read_arm(folder: Path) -> tuple[dict[Key, dict[int, float]], dict[Key, float]]:
    """One arm's headline value per (norm, batch size) and seed at the chosen rate, and BN's tail steps per update
    (mean over those seeds)."""
    for name, columns in (("results.csv", RESULTS_COLUMNS), ("trials.csv", TRIALS_COLUMNS)):
        if not (folder / name).is_file():
            raise SystemExit(
                f"compare_arms.py: expected {folder / name} (a batch_size_sweep.py --out folder), got none"
            )
        with open(folder / name, newline="") as file:
            missing = sorted(set(columns) - set(csv.DictReader(file).fieldnames or ()))
        if missing:  # another script's folder: a KeyError deep in the reading, before
            raise SystemExit(
                f"compare_arms.py: expected {folder / name} of a batch_size_sweep.py --out folder, with the columns "
                f"{', '.join(columns)}; got one without {', '.join(missing)}"
            )
    chosen: dict[Key, tuple[str, str]] = {}
    with open(folder / "results.csv", newline="") as file:
        for row in csv.DictReader(file):
            if row["status"] == "ok" and row["lr"]:
                metric = "val_bpc_exact" if row.get("lr_chosen_on", "").endswith("_exact") else "val_bpc"
                chosen[(row["norm"], int(row["batch_size"]))] = (row["lr"], metric)
    values: dict[Key, dict[int, float]] = {}
    tails: dict[Key, list[float]] = {}
    with open(folder / "trials.csv", newline="") as file:
        for row in csv.DictReader(file):
            key = (row["norm"], int(row["batch_size"]))
            if key not in chosen or row["status"] != "ok" or float(row["lr"]) != float(chosen[key][0]):
                continue
            if int(row["seed"]) >= _protocol.SELECTION_SEEDS_FROM:
                continue  # the seeds that chose the rate (--select apart) are not reported
            values.setdefault(key, {})[int(row["seed"])] = float(row[chosen[key][1]])
            if row.get("fallback_per_update"):
                tails.setdefault(key, []).append(float(row["fallback_per_update"]))
    return values, {key: statistics.fmean(found) for key, found in tails.items()}


def compare(first: Path, second: Path, names: Sequence[str]) -> list[dict[str, object]]:
    """One row per norm and batch size both arms have (the plain LSTM is the baseline, not a row)."""
    (values_a, tails_a), (values_b, tails_b) = read_arm(first), read_arm(second)
    rows: list[dict[str, object]] = []
    for norm, batch in sorted(set(values_a) & set(values_b), key=lambda key: (key[1], key[0])):
        if norm == "none" or ("none", batch) not in values_a or ("none", batch) not in values_b:
            continue
        diff_a = _protocol.paired_difference(values_a[(norm, batch)], values_a[("none", batch)])
        diff_b = _protocol.paired_difference(values_b[(norm, batch)], values_b[("none", batch)])
        if diff_a is None or diff_b is None:
            continue
        change = _protocol.paired_difference(diff_b.differences, diff_a.differences)
        row: dict[str, object] = {"norm": norm, "batch_size": batch}
        for name, paired, tails in ((names[0], diff_a, tails_a), (names[1], diff_b, tails_b)):
            row.update(_protocol.paired_columns(paired, f"{name}_diff_vs_none"))
            row[f"{name}_tail_steps_per_update"] = tails.get((norm, batch), math.nan)
        row.update(_protocol.paired_columns(change, "change"))
        row["texts"] = (_protocol.paired_text(diff_a), _protocol.paired_text(diff_b), _protocol.paired_text(change))
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, object]], names: Sequence[str]) -> str:
    """The comparison as a Markdown table."""

    def tails(value: object) -> str:
        return "" if not isinstance(value, float) or math.isnan(value) else f"{value:.2f}"

    lines = [
        f"| norm | B | minus none, {names[0]} | minus none, {names[1]} | change ({names[1]} − {names[0]}) "
        f"| tail steps per update, {names[0]} / {names[1]} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        text_a, text_b, text_change = row["texts"]  # type: ignore[misc]
        tail_a, tail_b = row[f"{names[0]}_tail_steps_per_update"], row[f"{names[1]}_tail_steps_per_update"]
        spent = f"{tails(tail_a)} / {tails(tail_b)}" if tails(tail_a) else ""
        lines.append(f"| {row['norm']} | {row['batch_size']} | {text_a} | {text_b} | {text_change} | {spent} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="the first arm's --out folder of batch_size_sweep.py")
    parser.add_argument("second", type=Path, help="the second arm's --out folder")
    parser.add_argument("--names", nargs=2, default=("first", "second"), help="what to call the two arms")
    parser.add_argument("--out", type=Path, default=None, help="write comparison.md and comparison.csv here")
    args = parser.parse_args(argv)
    if args.out is not None:
        _common.writable_folder(args.out, "--out")
    rows = compare(args.first, args.second, args.names)
    if not rows:
        parser.error(
            f"expected norms beside a plain LSTM at a batch size both arms ran, got none in {args.first}, {args.second}"
        )
    text = table(rows, args.names)
    print(text)
    if args.out is not None:
        command = " ".join(["python scripts/compare_arms.py", *sys.argv[1:]]) if argv is None else ""
        (args.out / "comparison.md").write_text(f"{text}\n\nCommand: `{command}`\n" if command else f"{text}\n")
        _common.write_csv(args.out / "comparison.csv", rows, [key for key in rows[0] if key != "texts"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
