"""The one exception type of the data layer.

Every problem with the user's data or data flags raises :class:`DataError`. It subclasses :class:`ValueError` so
generic ``except ValueError`` handlers keep working, and its message is one paragraph that names the file (or the
``--data.*`` flag) and says what to do.
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data file, a dataset download or a ``--data.*`` argument cannot be used.

    The message names the file (``path`` or ``path:line``) or the CLI flag (e.g. ``--data.encoding``) and says how
    to fix the problem.
    """
