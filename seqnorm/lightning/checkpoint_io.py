"""The one way seqnorm reads a checkpoint: ``torch.load(weights_only=True)``, each failure one readable error.

A checkpoint is a pickle, and unpickling an untrusted pickle can run any code. ``weights_only=True`` makes torch
unpickle with an allow-list (tensors, plain containers, numbers, strings) and refuse everything else *before*
calling it, so a crafted file is refused and nothing in it is executed. seqnorm's checkpoints hold only such plain
values (the vocabulary is stored as lists and dicts), so nothing needs to be allow-listed beyond
:data:`ALLOWED_GLOBALS`.

A checkpoint also names the class to build (``hyper_parameters["_class_path"]``, written by LightningCLI);
:func:`task_class` resolves it only among classes given by the caller and never imports the named module.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

__all__ = [
    "ALLOWED_GLOBALS",
    "CHECKPOINT_KEYS",
    "CheckpointError",
    "corrupt_checkpoint",
    "names_class",
    "read_checkpoint",
    "task_class",
]

ALLOWED_GLOBALS: list[Any] = []
"""Types a checkpoint may hold beyond torch's weights-only defaults (``torch.serialization.safe_globals``).

Empty: everything seqnorm writes is a tensor or a plain container. Add a type here only if it is inert data.
"""

CHECKPOINT_KEYS = ("state_dict", "hyper_parameters")
"""Keys every checkpoint written by ``seqnorm fit`` holds."""

INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"
"""The only ``_instantiator`` a checkpoint may name: the one LightningCLI writes (and Lightning allow-lists)."""


class CheckpointError(ValueError):
    """A checkpoint file cannot be used; the message names the flag and the file and says what to do."""


def corrupt_checkpoint(where: str, what: str) -> CheckpointError:
    """The error for a checkpoint that loads safely but holds what ``seqnorm fit`` never writes (``what``);
    ``where`` names the flag and the file."""
    return CheckpointError(f"{where}: a corrupt checkpoint: {what}; use one written by `seqnorm fit` as it was")


def _refused_globals(path: Path, error: Exception) -> str:
    """The globals a refused pickle asked for, from torch's own scan (reads opcodes only) or its message."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a legacy (non-zip) file or a broken zip: fall back to the one global torch named
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        names = [found.group(1)] if found else []
    return ", ".join(names) if names else "something outside torch's weights-only allow-list"


def read_checkpoint(path: str | os.PathLike[str], flag: str = "--ckpt_path") -> dict[str, Any]:
    """Load a checkpoint written by ``seqnorm fit`` without running code from it.

    Args:
        path: the checkpoint file.
        flag: the option that named it, for the message (``--ckpt_path``, ``load_from_checkpoint``, ...).

    Returns:
        The checkpoint dict (tensors on the CPU).

    Raises:
        CheckpointError: the file is missing, a directory, empty, truncated or corrupt, not a torch file, a pickle
            that asks for anything outside the allow-list (refused before anything in it runs), not a dict with
            :data:`CHECKPOINT_KEYS`, names an ``_instantiator`` other than LightningCLI's, or nests a
            ``class_path`` in its hyperparameters, as a dict or inside a string that YAML reads as a mapping or a
            list or that names a file (jsonargparse would import and build it when the model is built).
    """
    where = f"{flag} {path}"
    file = Path(path)
    if file.is_dir():
        raise CheckpointError(f"{where}: is a directory, expected a checkpoint file such as .../checkpoints/last.ckpt")
    if not file.is_file():
        raise CheckpointError(f"{where}: no such checkpoint file")
    size = file.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"{where}: the file is empty (0 bytes), not a checkpoint; a run stopped while saving can leave one: "
            "use an earlier checkpoint"
        )
    with open(file, "rb") as handle:
        magic = handle.read(4)
    zipped = magic == b"PK\x03\x04"  # what torch.save writes
    pickled = magic[:1] == b"\x80"  # a bare pickle (protocol 2+), as torch's legacy format is
    not_torch = f"{where}: not a PyTorch checkpoint (not a file written by torch.save): use another checkpoint"
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            # a foreign pickle also makes torch warn about its protocol: the error below says all there is to say
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not (zipped or pickled):
            raise CheckpointError(not_torch) from None
        raise CheckpointError(
            f"{where}: refused: the file asks to call or build {_refused_globals(file, error)}, which a checkpoint "
            "never needs; it was not loaded and nothing in it was executed. Use a checkpoint written by "
            "`seqnorm fit` that you trust"
        ) from None
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, IndexError) as error:
        if not zipped:  # torch reports a text file as a KeyError of its first byte
            raise CheckpointError(not_torch) from None
        raise CheckpointError(
            f"{where}: the file ({size} bytes) is truncated or corrupt, as a run stopped while saving can leave it "
            f"(torch: {type(error).__name__}: {error}): use another checkpoint"
        ) from None
    if not isinstance(checkpoint, dict) or not all(key in checkpoint for key in CHECKPOINT_KEYS):
        held = f"a dict with keys {sorted(map(str, checkpoint))[:6]}" if isinstance(checkpoint, dict) else None
        raise CheckpointError(
            f"{where}: a torch file, but not a checkpoint written by `seqnorm fit`: expected a dict with "
            f"{' and '.join(CHECKPOINT_KEYS)}, got {held or type(checkpoint).__name__}"
        )
    hparams = checkpoint["hyper_parameters"]
    if not isinstance(hparams, dict):
        raise CheckpointError(f"{where}: expected hyper_parameters to be a dict, got {type(hparams).__name__}")
    nested = _class_path_inside(hparams)
    if nested is not None:
        raise CheckpointError(
            f"{where}: refused: its hyper_parameters.{nested[0]} names the class {nested[1]!r}; seqnorm's "
            "hyperparameters are plain values, and the named module was not imported"
        )
    encoded = _structure_in_string(hparams)
    if encoded is not None:
        raise CheckpointError(
            f"{where}: refused: its hyper_parameters.{encoded} is a string holding YAML/JSON structure or naming a "
            "file (jsonargparse would parse it, and could import and build a class it names); seqnorm's "
            "hyperparameters are plain values, and nothing in it was parsed or imported"
        )
    instantiator = hparams.get("_instantiator")
    if instantiator is not None and instantiator != INSTANTIATOR:
        raise CheckpointError(
            f"{where}: refused: its hyper_parameters name the instantiator {instantiator!r}; only {INSTANTIATOR} "
            "is accepted, and the named one was not imported"
        )
    return checkpoint


def _walk(value: object, where: str = "") -> Iterator[tuple[str, object]]:
    """Every value nested in ``value``'s dicts, lists and tuples (``value`` first), each with its key path."""
    yield where or "(top level)", value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _walk(item, f"{where}[{index}]")


def _class_path_inside(value: object) -> tuple[str, object] | None:
    """``(key path, class path)`` of a nested ``{"class_path": ...}`` dict, which jsonargparse would import."""
    return next(
        ((path, node["class_path"]) for path, node in _walk(value) if isinstance(node, dict) and "class_path" in node),
        None,
    )


def _structure_in_string(value: object) -> str | None:
    """The key path of a string that YAML reads as a mapping or a list, that mentions ``class_path``, or that names
    an existing file.

    jsonargparse parses a string given for a loosely typed field (``Any``, ``dict[str, Any]``) as YAML, reads a
    string naming a file as a config file for a class-typed one (``norm``), and builds any ``{"class_path": ...}``
    it finds there: a dict hidden in a string, or in a file beside the checkpoint, is how a checkpoint would smuggle
    one past :func:`_class_path_inside`. seqnorm's model hyperparameters hold only names and numbers as strings.
    """
    return next((path for path, node in _walk(value) if isinstance(node, str) and _encodes_structure(node)), None)


def _encodes_structure(text: str) -> bool:
    if "class_path" in text or (len(text) < 4096 and os.path.isfile(text)):
        return True
    if not text.lstrip().startswith(("{", "[", "-")) and ":" not in text:
        return False  # a plain scalar: no YAML structure possible (the fast, usual case)
    try:
        return isinstance(yaml.safe_load(text), dict | list)
    except yaml.YAMLError:
        return False  # not YAML: jsonargparse keeps it a string


def names_class(class_path: object, cls: type) -> bool:
    """Whether ``class_path`` names ``cls``, by its defining module or an already imported package exporting it.

    Only ``sys.modules`` is consulted: nothing is imported.
    """
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    if class_path == f"{cls.__module__}.{cls.__qualname__}":
        return True
    module_name, _, name = class_path.rpartition(".")
    module = sys.modules.get(module_name)
    return module is not None and getattr(module, name, None) is cls


def task_class(
    checkpoint: dict[str, Any], allowed: Sequence[type], path: str | os.PathLike[str], flag: str = "--ckpt_path"
) -> type | None:
    """The class among ``allowed`` that the checkpoint's ``hyper_parameters["_class_path"]`` names.

    Both a class's defining path (``seqnorm.lightning.language_model.LanguageModel``) and a path through an
    already imported package that exports it (``seqnorm.lightning.LanguageModel``, what the CLI writes) match
    (:func:`names_class`); the named module is never imported, so a checkpoint cannot make seqnorm run a module of
    its choice. Returns ``None`` for a checkpoint written without the CLI (no ``_class_path``).
    """
    class_path = checkpoint["hyper_parameters"].get("_class_path")
    if class_path is None:
        return None
    for cls in allowed:
        if names_class(class_path, cls):
            return cls
    names = ", ".join(cls.__name__ for cls in allowed)
    raise CheckpointError(
        f"{flag} {path}: refused: the checkpoint's hyper_parameters name the class {class_path!r}, which is not "
        f"one of {names}; the named module was not imported. Use a checkpoint written by `seqnorm fit`"
    )
