"""The one way seqnorm reads a checkpoint: ``torch.load(weights_only=True)``, each failure one readable error.

A checkpoint is a pickle, and unpickling an untrusted pickle can run any code. ``weights_only=True`` makes torch
unpickle with an allow-list (tensors, plain containers, numbers, strings) and refuse everything else *before*
calling it, so a crafted file is refused and nothing in it is executed. seqnorm's checkpoints hold only such plain
values (the vocabulary is stored as lists and dicts), so nothing needs to be allow-listed beyond
:data:`ALLOWED_GLOBALS`.

A checkpoint also names the class to build (``hyper_parameters["_class_path"]``, written by LightningCLI), and the
data's (``datamodule_hyper_parameters["_class_path"]``); :func:`task_class` and :func:`data_class` resolve them only
among classes given by the caller and never import the named module.

Each checkpoint is read from disk once: the checks and the model built from it see the same bytes. Reading the path
again after the checks (as Lightning's own loaders do) would let a file swapped in between — a symlink flipped to a
crafted file — be built unchecked, and jsonargparse would import the class it names.
"""

from __future__ import annotations

import io
import math
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
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

__all__ = [
    "ALLOWED_GLOBALS",
    "CHECKPOINT_KEYS",
    "DATA_HPARAMS_KEY",
    "CheckedCheckpointIO",
    "CheckpointError",
    "check_data_hyper_parameters",
    "check_hyper_parameters",
    "checked_stream",
    "corrupt_checkpoint",
    "data_class",
    "names_class",
    "read_checkpoint",
    "read_hparams_file",
    "refuse_unsafe_load",
    "shown",
    "subclasses",
    "task_class",
]

ALLOWED_GLOBALS: list[Any] = []
"""Types a checkpoint may hold beyond torch's weights-only defaults (``torch.serialization.safe_globals``).

Empty: everything seqnorm writes is a tensor or a plain container. Add a type here only if it is inert data.
"""

CHECKPOINT_KEYS = ("state_dict", "hyper_parameters")
"""Keys every checkpoint written by ``seqnorm fit`` holds."""

DATA_HPARAMS_KEY = "datamodule_hyper_parameters"
"""Where Lightning saves a DataModule's ``save_hyperparameters()`` (its ``CHECKPOINT_HYPER_PARAMS_KEY``): for
seqnorm's data modules, the arguments the run's data was made with, each a plain value."""

INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"
"""The only ``_instantiator`` a checkpoint may name: the one LightningCLI writes (and Lightning allow-lists)."""


def subclasses(cls: type) -> list[type]:
    """``cls`` and every subclass of it defined so far: the classes a checkpoint saved by ``cls``'s
    ``load_from_checkpoint`` may name (:func:`task_class`, :func:`data_class`)."""
    return [cls, *(found for subclass in cls.__subclasses__() for found in subclasses(subclass))]


class CheckpointError(ValueError):
    """A checkpoint file cannot be used; the message names the flag and the file and says what to do."""


def corrupt_checkpoint(where: str, what: str) -> CheckpointError:
    """The error for a checkpoint that loads safely but holds what ``seqnorm fit`` never writes (``what``);
    ``where`` names the flag and the file."""
    return CheckpointError(f"{where}: a corrupt checkpoint: {what}; use one written by `seqnorm fit` as it was")


def _refused_globals(data: bytes, error: Exception) -> str:
    """The globals a refused pickle asked for, from torch's own scan (reads opcodes only) or its message."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # a legacy (non-zip) file or a broken zip: fall back to the one global torch named
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        names = [found.group(1)] if found else []
    return ", ".join(names) if names else "something outside torch's weights-only allow-list"


def refuse_unsafe_load(weights_only: object, flag: str) -> None:
    """A ``load_from_checkpoint(..., weights_only=False)`` is one error, as ``--weights_only false`` is: seqnorm
    reads checkpoints with ``weights_only=True`` only (Lightning's keyword, passed on, was a bare ``TypeError``)."""
    if weights_only is not None and weights_only is not True:
        raise CheckpointError(
            f"{flag}: weights_only={weights_only!r}: refused: seqnorm loads checkpoints with weights_only=True only, "
            "since unpickling anything else can run code; checkpoints written by `seqnorm fit` need nothing more"
        )


def read_checkpoint(path: str | os.PathLike[str], flag: str = "--ckpt_path") -> dict[str, Any]:
    """Load a checkpoint written by ``seqnorm fit`` without running code from it.

    The file is read once, into memory; every check below and the returned dict come from those bytes. Whatever
    builds a model from a checkpoint must build it from this dict (:func:`checked_stream`,
    :class:`CheckedCheckpointIO`), never by reading the path again: a file swapped between two reads would be built
    unchecked.

    Args:
        path: the checkpoint file.
        flag: the option that named it, for the message (``--ckpt_path``, ``load_from_checkpoint``, ...).

    Returns:
        The checkpoint dict (tensors on the CPU).

    Raises:
        CheckpointError: the file is missing, a directory, empty, truncated or corrupt, not a torch file, a pickle
            that asks for anything outside the allow-list (refused before anything in it runs), not a dict with
            :data:`CHECKPOINT_KEYS`, it holds Lightning's keys of before 1.0 (:data:`PAST_HPARAMS_KEYS`) or an
            argument name other than ``"kwargs"`` (:data:`HPARAMS_NAME_KEYS`), its hyperparameters fail
            :func:`check_hyper_parameters`, or its weights hold NaN or inf.
    """
    where = f"{flag} {path}"
    file = Path(path)
    try:
        data = file.read_bytes()
    except IsADirectoryError:
        raise CheckpointError(
            f"{where}: is a directory, expected a checkpoint file such as .../checkpoints/last.ckpt"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no such checkpoint file") from None
    except OSError as error:
        raise CheckpointError(f"{where}: cannot be read ({error.strerror or error})") from None
    if not data:
        raise CheckpointError(
            f"{where}: the file is empty (0 bytes), not a checkpoint; a run stopped while saving can leave one: "
            "use an earlier checkpoint"
        )
    zipped = data[:4] == b"PK\x03\x04"  # what torch.save writes
    pickled = data[:1] == b"\x80"  # a bare pickle (protocol 2+), as torch's legacy format is
    not_torch = f"{where}: not a PyTorch checkpoint (not a file written by torch.save): use another checkpoint"
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            # a foreign pickle also makes torch warn about its protocol: the error below says all there is to say
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not (zipped or pickled):
            raise CheckpointError(not_torch) from None
        raise CheckpointError(
            f"{where}: refused: the file asks to call or build {_refused_globals(data, error)}, which a checkpoint "
            "never needs; it was not loaded and nothing in it was executed. Use a checkpoint written by "
            "`seqnorm fit` that you trust"
        ) from None
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, IndexError) as error:
        if not zipped:  # torch reports a text file as a KeyError of its first byte
            raise CheckpointError(not_torch) from None
        raise CheckpointError(
            f"{where}: the file ({len(data)} bytes) is truncated or corrupt, as a run stopped while saving can leave "
            f"it (torch: {type(error).__name__}: {error}): use another checkpoint"
        ) from None
    if not isinstance(checkpoint, dict) or not all(key in checkpoint for key in CHECKPOINT_KEYS):
        held = f"a dict with keys {sorted(map(str, checkpoint))[:6]}" if isinstance(checkpoint, dict) else None
        raise CheckpointError(
            f"{where}: a torch file, but not a checkpoint written by `seqnorm fit`: expected a dict with "
            f"{' and '.join(CHECKPOINT_KEYS)}, got {held or type(checkpoint).__name__}"
        )
    _check_lightning_keys(checkpoint, where)
    check_hyper_parameters(checkpoint["hyper_parameters"], where)
    check_data_hyper_parameters(checkpoint.get(DATA_HPARAMS_KEY), where)
    _check_finite_weights(checkpoint["state_dict"], where)
    _check_training_state(checkpoint, where)
    return checkpoint


LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")
"""The loops whose state Lightning saves under ``loops`` and restores by name."""


def shown(value: object) -> str:
    """``value`` as an error quotes what it got: its ``repr``, or its type where that runs past 80 characters."""
    return repr(value) if len(repr(value)) <= 80 else f"a {type(value).__name__}"


def _non_finite(value: object) -> bool:
    """Whether ``value`` (an optimizer's state: tensors, numbers, containers of them) holds a NaN or an inf."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(item) for item in value)
    return False


def _check_training_state(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse the state Lightning restores beside the weights where it is not of the kind Lightning writes, or the
    optimizer's holds NaN or inf: each was a traceback from deep in Lightning's restore (``KeyError: 'test_loop'``,
    an ``AttributeError`` of a string, a ``KeyError`` in the migration of a version-0.9 file), and a NaN Adam moment
    trained the weights to NaN and saved them."""

    def refuse(key: str, expected: str) -> CheckpointError:
        return corrupt_checkpoint(where, f"expected its {key} to be {expected}, got {shown(checkpoint[key])}")

    def dicts(value: object) -> bool:
        return isinstance(value, list) and all(isinstance(item, dict) for item in value)

    version = checkpoint.get("pytorch-lightning_version")
    if version is not None:
        major = re.match(r"(\d+)\.\d+", version) if isinstance(version, str) else None
        if major is None or int(major.group(1)) < 2:
            raise refuse("pytorch-lightning_version", "a version of Lightning 2 or later, which seqnorm fit writes")
    for key in ("epoch", "global_step"):
        value = checkpoint.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise refuse(key, "a count")
    loops = checkpoint.get("loops")
    if "loops" in checkpoint and not (isinstance(loops, dict) and all(isinstance(loops.get(n), dict) for n in LOOPS)):
        raise refuse("loops", f"a dict of the states of {', '.join(LOOPS)}")
    callbacks = checkpoint.get("callbacks", {})
    if not isinstance(callbacks, dict) or not all(isinstance(state, dict) for state in callbacks.values()):
        raise refuse("callbacks", "a dict of the callbacks' states")
    optimizers = checkpoint.get("optimizer_states", [])
    if not dicts(optimizers) or not all(
        isinstance(state.get("state"), dict) and dicts(state.get("param_groups")) for state in optimizers
    ):
        raise refuse("optimizer_states", "a list of optimizer states (each its state and param_groups)")
    if _non_finite(optimizers):
        raise corrupt_checkpoint(where, "its optimizer_states hold NaN or inf, from which training makes NaN weights")
    if not dicts(checkpoint.get("lr_schedulers", [])):
        raise refuse("lr_schedulers", "a list of the schedulers' states")


PAST_HPARAMS_KEYS = ("hparams", "module_arguments")
"""Lightning's hyperparameter keys of before 1.0, which its loader still merges into the model's arguments, beside
and under ``hyper_parameters``: seqnorm never writes them, and what they hold would be built unchecked."""

HPARAMS_NAME_KEYS = ("hparams_name", "datamodule_hparams_name")
"""Where Lightning records the name of the ``__init__`` argument the hyperparameters were collected from:
``"kwargs"`` for seqnorm's modules (``save_hyperparameters()``); another name wraps them all into that one
argument when the model is built."""


def _check_lightning_keys(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse the keys through which Lightning's loader would build the model from anything but the checked
    ``hyper_parameters``: a crafted ``hparams`` key of before 1.0 had jsonargparse build a class it named (a shell
    command, through ``subprocess.Popen``) in ``load_from_checkpoint`` and ``seqnorm generate``."""
    for key in PAST_HPARAMS_KEYS:
        if key in checkpoint:
            raise CheckpointError(
                f"{where}: refused: it holds {key!r}, Lightning's hyperparameter key of before 1.0, which seqnorm "
                "never writes and Lightning would build the model from unchecked; nothing in it was built"
            )
    for key in HPARAMS_NAME_KEYS:
        name = checkpoint.get(key, "kwargs")
        if name not in ("kwargs", None):
            raise corrupt_checkpoint(where, f"expected its {key} to be 'kwargs', got {shown(name)}")


def _check_finite_weights(state_dict: object, where: str) -> None:
    """Refuse weights holding NaN or inf (a run that diverged saves them): evaluated, they give NaN metrics and
    predictions, generation fails on its probabilities, and a resumed run trains on NaN. Refuse as well the finite
    values that make NaN of every output and that no training writes: a negative running variance of batch norm
    (the square root of it), a weight-norm direction (``parametrizations.<weight>.original1``) with a row of zeros
    (divided by its norm)."""
    if not isinstance(state_dict, dict):
        return  # the model's own load_state_dict says what it expected
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"{where}: its weights hold NaN or inf (state_dict.{name}), as a run that diverged saves them: use "
                "an earlier checkpoint (a best-*.ckpt of the run), or train again with a lower --model.lr"
            )
        if str(name).endswith("running_var") and bool((value < 0).any()):
            raise corrupt_checkpoint(where, f"its state_dict.{name} holds a negative variance")
        if str(name).endswith(".original1") and value.dim() >= 2 and bool((value.flatten(1) == 0).all(1).any()):
            raise corrupt_checkpoint(where, f"its state_dict.{name} (a weight norm's direction) has a row of zeros")


def check_hyper_parameters(hparams: object, where: str) -> None:
    """Refuse hyperparameters from which jsonargparse could import or build a class, or read a file.

    Raises:
        CheckpointError: ``hparams`` is not a dict, names an ``_instantiator`` other than LightningCLI's, or nests
            a ``class_path``, as a dict or inside a string that YAML reads as a mapping or a list or that names a
            file (jsonargparse would import and build it when the model is built). ``where`` names the flag and
            the file.
    """
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
    _check_instantiator(hparams, "hyper_parameters", where)


def check_data_hyper_parameters(hparams: object, where: str) -> None:
    """Refuse data hyperparameters (:data:`DATA_HPARAMS_KEY`) other than plain values under string names.

    seqnorm's data modules take only names, numbers, switches and file paths; a path is typed ``str`` and never
    read as a config, so unlike the model's strings it may name a file. ``None`` (a checkpoint without them) passes.

    Raises:
        CheckpointError: ``hparams`` is not a dict, holds a value that is not ``None``, a bool, a number or a
            string (a nested dict or list, where jsonargparse could find a ``class_path``), or names an
            ``_instantiator`` other than LightningCLI's.
    """
    if hparams is None:
        return
    if not isinstance(hparams, dict):
        raise CheckpointError(f"{where}: expected {DATA_HPARAMS_KEY} to be a dict, got {type(hparams).__name__}")
    for name, value in hparams.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, str | int | float | bool)):
            raise CheckpointError(
                f"{where}: refused: its {DATA_HPARAMS_KEY}.{name} is a {type(value).__name__}; seqnorm's data "
                "arguments are plain values (names, numbers, paths), and nothing in it was parsed or imported"
            )
    _check_instantiator(hparams, DATA_HPARAMS_KEY, where)


def _check_instantiator(hparams: dict[str, Any], key: str, where: str) -> None:
    """Refuse an ``_instantiator`` other than LightningCLI's in the hyperparameters saved under ``key``."""
    instantiator = hparams.get("_instantiator")
    if instantiator is not None and instantiator != INSTANTIATOR:
        raise CheckpointError(
            f"{where}: refused: its {key} name the instantiator {instantiator!r}; only {INSTANTIATOR} is accepted, "
            "and the named one was not imported"
        )


class _AliasFound(yaml.YAMLError):
    pass


class _PlainLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing aliases (``*name``): plain hyperparameters never need one, and nested
    aliases ("billion laughs": nine aliases of nine aliases ... of a string) expand into 10**9 values in whatever
    walks or copies the result."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasFound(f"*{event.anchor} on line {event.start_mark.line + 1}")
        return super().compose_node(parent, index)


def read_hparams_file(path: str | os.PathLike[str], where: str) -> dict[str, Any]:
    """Hyperparameters from a YAML file (``load_from_checkpoint``'s ``hparams_file``), read once as
    ``yaml.safe_load`` would (no Python objects), without aliases, and checked by :func:`check_hyper_parameters`."""
    where = f"{where} {path}"
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml"):
        raise CheckpointError(f"{where}: expected a .yaml or .yml file, got {suffix or 'no suffix'}")
    try:
        hparams = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_PlainLoader)  # a SafeLoader
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{where}: cannot be read ({error})") from None
    except _AliasFound as error:
        raise CheckpointError(
            f"{where}: refused: it uses a YAML alias ({error}); seqnorm's hyperparameters are plain values that "
            'never need one, and nested aliases expand beyond any memory (a "billion laughs" file)'
        ) from None
    except yaml.YAMLError as error:
        raise CheckpointError(f"{where}: not YAML ({' '.join(str(error).split())})") from None
    check_hyper_parameters(hparams, where)
    return hparams


def checked_stream(checkpoint: dict[str, Any]) -> io.BytesIO:
    """``checkpoint`` (a dict :func:`read_checkpoint` returned) serialized into memory, for Lightning's loaders.

    Lightning's ``load_from_checkpoint`` takes a path or a file object: given this stream, it builds the model from
    exactly the checked dict, and the file on disk is not read again.
    """
    stream = io.BytesIO()
    torch.save(checkpoint, stream)
    stream.seek(0)
    return stream


class CheckedCheckpointIO(_WrappingCheckpointIO):
    """The Trainer's checkpoint plugin, serving the checkpoint the CLI read and checked instead of reading it again.

    ``seqnorm fit|validate|test|predict --ckpt_path X`` reads and checks ``X`` before anything is built
    (:func:`read_checkpoint`); the Trainer then restores weights, optimizer and loop state through its strategy's
    ``load_checkpoint``, which reaches this plugin: for ``X`` it returns that checked dict, so a file swapped after
    the check is never what the run restores. Any other path is read through :func:`read_checkpoint` too. Saving
    and removing go to the wrapped plugin (Lightning's default, or the user's own).
    """

    def __init__(self, path: str | os.PathLike[str], checkpoint: dict[str, Any], wrapped: Any = None) -> None:
        super().__init__(wrapped)
        self._path = os.fspath(path)
        self._checkpoint = checkpoint

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        del map_location, weights_only  # tensors on the CPU, and weights only, always: the Trainer moves them
        if os.fspath(path) == self._path:
            return self._checkpoint
        return read_checkpoint(path)


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
    return None if class_path is None else _allowed_class(class_path, allowed, "hyper_parameters", f"{flag} {path}")


def data_class(
    checkpoint: dict[str, Any], allowed: Sequence[type], path: str | os.PathLike[str], flag: str = "--ckpt_path"
) -> type | None:
    """The DataModule class among ``allowed`` that the checkpoint's run read its data with.

    Named by ``datamodule_hyper_parameters["_class_path"]`` (written by LightningCLI), or, in a checkpoint written
    without it (before seqnorm saved its ``TextCorpus`` arguments, or by a plain ``Trainer.fit``), by the key
    Lightning saves the DataModule's state under, its class name. Never imports anything, as :func:`task_class`.
    Returns ``None`` when neither is there (a run without a DataModule).
    """
    class_path = (checkpoint.get(DATA_HPARAMS_KEY) or {}).get("_class_path")
    if class_path is not None:
        return _allowed_class(class_path, allowed, DATA_HPARAMS_KEY, f"{flag} {path}")
    return next((cls for cls in allowed if isinstance(checkpoint.get(cls.__qualname__), dict)), None)


def _allowed_class(class_path: object, allowed: Sequence[type], key: str, where: str) -> type:
    for cls in allowed:
        if names_class(class_path, cls):
            return cls
    names = ", ".join(cls.__name__ for cls in allowed)
    raise CheckpointError(
        f"{where}: refused: the checkpoint's {key} name the class {class_path!r}, which is not one of {names}; the "
        "named module was not imported. Use a checkpoint written by `seqnorm fit`"
    )
