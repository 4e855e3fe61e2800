"""The embedded bracket tasks: deterministic, varied, well formed, labelled correctly (checked independently)."""

from __future__ import annotations

import statistics
from collections import Counter

from seqnorm.data import synthetic_labeled, synthetic_lines

PAIRS = {")": "(", "]": "[", "}": "{", ">": "<"}


def first_violation(text: str) -> int | None:
    """Index of the first closer that does not match, len(text) if brackets stay open, None if well nested.

    Written independently of seqnorm.data.synthetic.is_well_nested, to check its labels.
    """
    open_stack: list[str] = []
    for position, char in enumerate(text):
        if char in PAIRS.values():
            open_stack.append(char)
        elif char in PAIRS:
            if not open_stack or open_stack[-1] != PAIRS[char]:
                return position
            open_stack.pop()
    return len(text) if open_stack else None


def test_lines_are_deterministic_per_seed() -> None:
    assert synthetic_lines(50, seed=4) == synthetic_lines(50, seed=4)
    assert synthetic_lines(50, seed=4) != synthetic_lines(50, seed=5)
    assert synthetic_labeled(50, seed=4) == synthetic_labeled(50, seed=4)
    assert synthetic_labeled(50, seed=4) != synthetic_labeled(50, seed=5)


def test_lines_are_well_nested_with_varied_lengths() -> None:
    lines = synthetic_lines(1000, seed=0, min_length=5, max_length=80)
    assert all(first_violation(line) is None for line in lines)
    lengths = [len(line) for line in lines]
    assert min(lengths) >= 5 and max(lengths) <= 80
    assert len(set(lengths)) > 60 and statistics.pstdev(lengths) > 15
    assert all("\n" not in line for line in lines)
    # Brackets nest: a good share of lines hold a bracket opened three or more levels deep.
    assert sum("(" in line or "[" in line for line in lines) > 900


def test_labels_match_an_independent_check() -> None:
    examples = synthetic_labeled(1000, seed=1)
    counts = Counter(label for label, _ in examples)
    assert 400 < counts["valid"] < 600 and counts["valid"] + counts["invalid"] == 1000
    for label, text in examples:
        assert (first_violation(text) is None) == (label == "valid"), (label, text)


def test_invalid_strings_keep_bracket_counts_and_fail_late() -> None:
    invalid = [text for label, text in synthetic_labeled(1000, seed=2) if label == "invalid"]
    for text in invalid:
        counts = Counter(text)
        # Counting cannot tell: every bracket type is opened as often as it is closed.
        assert all(counts[opener] == counts[closer] for closer, opener in PAIRS.items())
    relative = [first_violation(text) / len(text) for text in invalid]
    assert statistics.median(relative) > 0.5


def test_separator_makes_symbols_words() -> None:
    ((label, text),) = synthetic_labeled(1, seed=3, separator=" ")
    assert all(len(symbol) == 1 for symbol in text.split(" "))
    assert label in {"valid", "invalid"}
