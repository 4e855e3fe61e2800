"""What the ``seqnorm`` command prints besides the run: no known noise, errors in the command line's words, and
generated text with its prompt.

Some messages appear on every Lightning run and say nothing about it, nor anything a user can act on; each is
silenced where it comes from, by its text or the module that raises it, so every other warning and info line shows:

- Lightning 2.6's advertisement for its cloud logger, an INFO record of the ``lightning.pytorch.utilities.rank_zero``
  logger ("💡 Tip: For seamless cloud logging ... litlogger"), dropped by a filter on that logger.
- torch 2.10+'s FutureWarning "`isinstance(treespec, LeafSpec)` is deprecated", raised where Lightning's
  ``lightning/pytorch/utilities/_pytree.py`` builds a ``LeafSpec`` (reported as Lightning-AI/pytorch-lightning#21326;
  Lightning 2.6.6 still does it), ignored for that module only.
- jsonargparse 4.49+'s DeprecationWarnings about the API that Lightning's ``lightning/pytorch/cli.py`` calls
  (``add_instantiator``, ``instantiate_classes``, ``skip_none``; Lightning-AI/pytorch-lightning#21900), ignored
  for that module only. Hidden by Python's default filters in a plain run, they fill test and ``-W default`` output.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from collections.abc import Iterable
from typing import TextIO

from rich.console import Console
from rich.text import Text

__all__ = ["PROMPT_STYLE", "in_command_line_words", "quiet_known_noise", "show_generated"]

PROMPT_STYLE = "bold"
"""How ``seqnorm generate`` sets the prompt apart from the continuation on a terminal."""

_LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where rank_zero_info writes (see Lightning)
_TIP_PREFIX = "💡 Tip: For seamless cloud"  # the litlogger tip (and litmodels', when Lightning makes the checkpointer)


class _DropLightningTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP_PREFIX)


_TIPS_FILTER = _DropLightningTips()


def quiet_known_noise() -> None:
    """Silence the messages of the module docstring; repeated calls add nothing."""
    logger = logging.getLogger(_LIGHTNING_INFO_LOGGER)
    if _TIPS_FILTER not in logger.filters:
        logger.addFilter(_TIPS_FILTER)
    warnings.filterwarnings(
        "ignore",
        message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
        category=FutureWarning,
        module=re.escape("lightning.pytorch.utilities._pytree") + r"\Z",
    )
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=re.escape("lightning.pytorch.cli") + r"\Z")


def _parameters(classes: Iterable[type]) -> set[str]:
    return {name for cls in classes for name in inspect.signature(cls.__init__).parameters if name != "self"}


def in_command_line_words(message: str, models: Iterable[type]) -> str:
    """``message`` with its Python-style suggestions of model arguments as the flags that set them.

    The library's errors suggest keyword arguments (``norm=BatchNormSpec(small_batch="running")``, ``norm="layer"``);
    under the CLI the same setting is ``--model.small_batch running``. Only double-quoted values of arguments the
    models take are rewritten: single-quoted ones are reprs of given values (``got 'x'``), not suggestions.
    """
    names = _parameters(models)

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        return f"--model.{name} {value}" if name in names else match.group(0)

    # a spec's option the models take as their own argument: norm=BatchNormSpec(small_batch="running")
    message = re.sub(r'\bnorm=[A-Z]\w*Spec\(([a-z_][a-z0-9_]*)="([^"\s]*)"\)', flag, message)
    message = re.sub(r'\b([a-z_][a-z0-9_]*)="([^"\s]*)"', flag, message)

    def setting(match: re.Match[str]) -> str:
        word, name, value = match.group(1), match.group(2), match.group(3)
        shown = value.lower() if value in ("True", "False") else value  # as the flag takes it (YAML)
        return f"{word} --model.{name} {shown}" if name in names else match.group(0)

    # a number or switch to set: "set embedding_dim=8 or tie_weights=False"
    return re.sub(r"\b(set|or) ([a-z_][a-z0-9_]*)=(True|False|-?\d+(?:\.\d+)?)\b", setting, message)


def show_generated(text: str, prompt_length: int, file: TextIO | None = None) -> None:
    """Print ``text`` (``seqnorm generate``'s prompt, then its continuation) and a line break.

    On a terminal the first ``prompt_length`` characters (the prompt) are in :data:`PROMPT_STYLE`, so the model's
    part stands apart; piped or redirected (or ``TERM=dumb``) the text is written as it is, with no escape codes.
    rich decides which, as for the progress bar (``FORCE_COLOR`` forces the styled form).
    """
    console = Console(file=file, soft_wrap=True, highlight=False, markup=False, emoji=False)
    if console.color_system is None:
        console.file.write(text + "\n")
        console.file.flush()
        return
    styled = Text(text)
    styled.stylize(PROMPT_STYLE, 0, prompt_length)
    console.print(styled)
