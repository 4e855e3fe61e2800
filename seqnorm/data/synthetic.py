"""An embedded, seeded task that rewards memory: nested brackets of four types around letters.

Each line is a well-nested string such as ``a(b[cd]{e<f>}g)h``: letters from ``a``–``h`` and brackets
``() [] {} <>``, nested up to ``max_depth`` deep, 5 to 80 characters long by default (uniformly drawn). Letters are
random, so they are unpredictable; a closing bracket is fully predictable, but only by a model that remembers which
brackets are open and in what order, possibly from dozens of steps back. A character-level LM that learns the
structure therefore gets visibly lower loss on closers than one that does not, and longer lines need longer memory.

The matching classification task labels a bracket string ``valid`` (well nested) or ``invalid``. Invalid strings
are made from valid ones by swapping two closing brackets of different types, the first of them as late in the
string as possible. The swap keeps every bracket count unchanged, so counting cannot solve the task: only a model
that tracks the stack of open brackets up to the swapped position can.

Nothing here reads a file or the network; the same ``seed`` always gives the same data.
"""

from __future__ import annotations

import random

__all__ = [
    "BRACKETS",
    "LETTERS",
    "is_well_nested",
    "synthetic_labeled",
    "synthetic_lines",
]

BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}
LETTERS = "abcdefgh"
_CLOSERS = {closer: opener for opener, closer in BRACKETS.items()}


def _bracket_string(rng: random.Random, length: int, max_depth: int) -> str:
    """One well-nested string of exactly ``length`` characters."""
    openers = list(BRACKETS)
    out: list[str] = []
    stack: list[str] = []
    for position in range(length):
        remaining = length - position
        if remaining == len(stack):  # every remaining slot is needed to close what is open
            out.append(BRACKETS[stack.pop()])
            continue
        can_open = len(stack) < max_depth and remaining >= len(stack) + 2
        choice = rng.random()
        if can_open and choice < 0.3:
            stack.append(rng.choice(openers))
            out.append(stack[-1])
        elif stack and choice < 0.55:
            out.append(BRACKETS[stack.pop()])
        else:
            out.append(rng.choice(LETTERS))
    return "".join(out)


def _check_lengths(min_length: int, max_length: int) -> None:
    if not 2 <= min_length <= max_length:
        raise ValueError(f"synthetic: need 2 <= min_length <= max_length, got {min_length} and {max_length}")


def synthetic_lines(
    n: int,
    seed: int = 0,
    *,
    min_length: int = 5,
    max_length: int = 80,
    max_depth: int = 8,
) -> list[str]:
    """``n`` well-nested bracket strings for language modelling (see the module docstring).

    Args:
        n: number of lines.
        seed: the same seed gives the same lines.
        min_length: shortest line, in characters.
        max_length: longest line, in characters.
        max_depth: deepest nesting.

    Returns:
        The lines, without newline characters.
    """
    _check_lengths(min_length, max_length)
    rng = random.Random(seed)
    return [_bracket_string(rng, rng.randint(min_length, max_length), max_depth) for _ in range(n)]


def is_well_nested(text: str) -> bool:
    """Whether every bracket in ``text`` is closed by the matching type, in order."""
    stack: list[str] = []
    for char in text:
        if char in BRACKETS:
            stack.append(char)
        elif char in _CLOSERS and (not stack or stack.pop() != _CLOSERS[char]):
            return False
    return not stack


def _corrupt(rng: random.Random, text: str) -> str | None:
    """Swap two closers of different types, the first as late as possible; ``None`` if no pair exists."""
    closers = [position for position, char in enumerate(text) if char in _CLOSERS]
    pairs = [(i, j) for index, i in enumerate(closers) for j in closers[index + 1 :] if text[i] != text[j]]
    if not pairs:
        return None
    latest = max(i for i, _ in pairs)
    # The mismatch shows at the first swapped closer, so keep it late (at least half as far in as the latest
    # possible one); a random choice among those keeps the position unpredictable.
    late = [pair for pair in pairs if pair[0] >= latest // 2]
    i, j = rng.choice(late)
    chars = list(text)
    chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


def synthetic_labeled(
    n: int,
    seed: int = 0,
    *,
    min_length: int = 8,
    max_length: int = 80,
    max_depth: int = 8,
    separator: str = "",
) -> list[tuple[str, str]]:
    """``n`` ``(label, text)`` pairs: bracket strings labelled ``valid`` or ``invalid`` (about half each).

    Args:
        n: number of examples.
        seed: the same seed gives the same examples.
        min_length: shortest string, in symbols.
        max_length: longest string, in symbols.
        max_depth: deepest nesting.
        separator: put between symbols; ``" "`` makes each symbol one word for word-level tokenization.

    Returns:
        ``(label, text)`` pairs, in the order of a ``label<TAB>text`` file.
    """
    _check_lengths(min_length, max_length)
    rng = random.Random(seed)
    examples: list[tuple[str, str]] = []
    while len(examples) < n:
        text = _bracket_string(rng, rng.randint(min_length, max_length), max_depth)
        label = "valid"
        if rng.random() < 0.5:
            corrupted = _corrupt(rng, text)
            if corrupted is None:  # too few closers of distinct types: draw another string
                continue
            text, label = corrupted, "invalid"
        examples.append((label, separator.join(text)))
    return examples
