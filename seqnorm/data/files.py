"""Reading the user's text files, with errors that say which file, which flag, and what to do."""

from __future__ import annotations

import codecs
from pathlib import Path

from seqnorm.data.errors import DataError

__all__ = ["check_encoding", "read_text"]


def check_encoding(encoding: str) -> None:
    """Raise a :class:`DataError` naming ``--data.encoding`` unless Python knows ``encoding`` as a text encoding
    (``rot13``, ``base64``, ``hex`` are codecs too, but do not decode bytes to text)."""
    try:
        info = codecs.lookup(encoding)
    except LookupError:
        info = None
    if info is None or not info._is_text_encoding:
        raise DataError(
            f"--data.encoding {encoding!r} is not a text encoding Python knows: pass one such as utf-8, latin-1 or "
            "cp1252"
        ) from None


def _encoding_name(encoding: str) -> str:
    name = codecs.lookup(encoding).name
    return "UTF-8" if name == "utf-8" else name


def read_text(path: str | Path, encoding: str = "utf-8", flag: str = "--data.path") -> str:
    """Read and decode a whole text file.

    Newlines are normalized to ``\\n`` and a leading byte-order mark is dropped.

    Args:
        path: the file.
        encoding: its text encoding.
        flag: the CLI flag the path came from, named in error messages.

    Returns:
        The text.

    Raises:
        DataError: the file is missing, a directory, unreadable, not valid text in ``encoding``, or holds only
            whitespace.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file (given as {flag}): check the path, or create the file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a text file (given as {flag}): pass a file inside it")
    try:
        raw = path.read_bytes()
    except PermissionError:
        raise DataError(
            f"{path}: cannot be read: permission denied (given as {flag}): make it readable (chmod +r) or copy it"
        ) from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error}) (given as {flag})") from None
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path}: not valid {_encoding_name(encoding)} at byte {error.start}: pass --data.encoding with the "
            "file's real encoding (e.g. --data.encoding latin-1 or cp1252), or convert the file to UTF-8"
        ) from None
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise DataError(f"{path}: the file is empty (given as {flag}): it needs text")
    return text
