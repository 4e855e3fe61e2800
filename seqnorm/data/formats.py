"""Text formats of corpus files: how a file's decoded contents become the text that is tokenized.

* ``plain``: the text as it is; every character (spaces and newlines included) is a token at ``--data.level char``.
* ``ptb_char``: Mikolov's character-level Penn Treebank (``ptb.char.*.txt``) and files like it: each line is one
  sentence spelled as single symbols separated by spaces, with ``_`` between words (``a e r _ b a n k``). The
  separator spaces are dropped and each ``_`` becomes one space (``aer bank``), so the tokens are the real characters.

Why ``_`` becomes a space rather than staying a symbol: the mapping is one to one, so the number of predicted symbols
(one per character, one per ``_``, one per line end), and with it bits per character, is exactly what papers report
for PTB-char, which count ``_`` as a symbol; and generated text and prompts read as ordinary text.

Why the format is checked: read as plain text, a PTB-char file has one separator space after nearly every
character. Those spaces are nearly free to predict yet count as characters, so about half the targets cost almost no
bits and bpc comes out about half of the true value. :func:`apply_text_format` therefore refuses a file that looks
like PTB-char unless the format was named, and a file named ``ptb_char`` that does not look like it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from seqnorm.data.errors import DataError

__all__ = [
    "TEXT_FORMATS",
    "TextFormat",
    "apply_text_format",
    "checked_format",
    "looks_like_ptb_char",
    "ptb_char_to_text",
]

TextFormat = Literal["plain", "ptb_char"]
TEXT_FORMATS: tuple[TextFormat, ...] = ("plain", "ptb_char")

# Only the start of a file is surveyed: a format is a property of the whole file, and reading the first ~200k
# characters keeps the check negligible beside tokenizing a 100M-character corpus.
_SURVEY_CHARS = 200_000
# Lines with fewer symbols say nothing about the format (a blank line, a heading, "I a" in prose).
_MIN_SYMBOLS = 4
_EXAMPLE_CHARS = 60


def ptb_char_to_text(text: str) -> str:
    """PTB-char text back to plain text: separators dropped, ``_`` read as the space between words, lines kept.

    Example:
        >>> ptb_char_to_text(" a e r _ b a n k \\n n o _ i t \\n")
        'aer bank\\nno it\\n'
    """
    return "\n".join("".join(" " if symbol == "_" else symbol for symbol in line.split()) for line in text.split("\n"))


class _Survey(NamedTuple):
    spaced: int  # lines made only of single symbols separated by whitespace
    other: int  # lines holding a longer token (plain text)
    first_spaced: str  # an example of each, for the error messages ("" if none)
    first_other: str


def _example(number: int, line: str) -> str:
    shown = line.strip()
    shown = shown if len(shown) <= _EXAMPLE_CHARS else shown[:_EXAMPLE_CHARS] + "..."
    return f"line {number}: {shown!r}"


def _survey(text: str) -> _Survey:
    spaced = other = 0
    first_spaced = first_other = ""
    for number, line in enumerate(text[:_SURVEY_CHARS].split("\n"), start=1):
        symbols = line.split()
        if len(symbols) < _MIN_SYMBOLS:
            continue
        if all(len(symbol) == 1 for symbol in symbols):
            spaced += 1
            first_spaced = first_spaced or _example(number, line)
        else:
            other += 1
            first_other = first_other or _example(number, line)
    return _Survey(spaced, other, first_spaced, first_other)


def looks_like_ptb_char(text: str) -> bool:
    """Whether most lines of ``text`` (those with at least 4 symbols, at its start) are single symbols separated by
    whitespace, as in PTB-char files."""
    survey = _survey(text)
    return survey.spaced > survey.other


def checked_format(saved: TextFormat | None) -> TextFormat | None:
    """The format to read new files with for a checkpoint's run that read its text as ``saved``: ``"ptb_char"`` as it
    is (which checks the look too), ``"plain"`` as ``None``, so that a file that looks like PTB-char is refused as at
    fit time rather than read unchecked: plain is a format, not an exemption (a word model scored a spaced character
    file at ppl 88.5, silently). A user's own ``--data.text_format plain`` still reads a file unchecked."""
    return None if saved == "plain" else saved


def apply_text_format(text: str, text_format: TextFormat | None, source: str) -> str:
    """The text to tokenize from a file's decoded contents (see the module docstring).

    Args:
        text: the decoded file (:func:`~seqnorm.data.files.read_text`).
        text_format: ``"plain"`` (taken as it is, unchecked), ``"ptb_char"`` (converted by
            :func:`ptb_char_to_text`), or ``None``: plain text, refused if it looks like PTB-char.
        source: the flag and file named in errors, e.g. ``"--data.path ptb.char.train.txt"``.

    Raises:
        DataError: ``None`` and the text looks like PTB-char; ``"ptb_char"`` and most lines hold longer tokens.
    """
    if text_format == "plain":
        return text
    survey = _survey(text)
    if text_format is None:
        if survey.spaced > survey.other:
            raise DataError(
                f"{source}: expected plain text, got what looks like PTB-char text (characters separated by spaces, "
                f"`_` between words): {survey.spaced} of the {survey.spaced + survey.other} lines checked are single "
                f"characters separated by spaces ({survey.first_spaced}). Read as plain text, every separator space "
                "would count as a character and bits per character would come out falsely good: pass "
                "--data.text_format ptb_char to drop the separators, or --data.text_format plain if the file really "
                "is plain text"
            )
        return text
    if text_format == "ptb_char":
        if survey.other > survey.spaced:
            raise DataError(
                f"{source}: expected PTB-char text for --data.text_format ptb_char (single characters separated by "
                f"spaces, `_` between words), got {survey.other} of the {survey.spaced + survey.other} lines checked "
                f"holding longer tokens ({survey.first_other}); read as PTB-char, its spaces would be dropped and its "
                "words run together: leave out --data.text_format to read it as plain text"
            )
        return ptb_char_to_text(text)
    raise DataError(f"--data.text_format {text_format!r}: choose one of {', '.join(TEXT_FORMATS)}")
