"""Checks the ``seqnorm`` command makes before it runs: flags against ``--ckpt_path``, the log folder, error text.

Kept apart from :mod:`seqnorm.cli.app` so that the command itself stays a short list of LightningCLI hooks.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_only

from seqnorm.checkpoint_io import DATA_HPARAMS_KEY, check_hyper_parameters, corrupt_checkpoint, names_class
from seqnorm.cli.runs import checkpoint_run_dir
from seqnorm.data.base import from_checkpoint
from seqnorm.data.formats import TEXT_FORMATS, checked_format
from seqnorm.lightning.base import DATA_STATE_KEY
from seqnorm.lightning.old_hparams import current_hparams
from seqnorm.norms import NORMS, NormSpec, spec_from_dict
from seqnorm.shipped_configs import config_values

__all__ = [
    "DATA_SOURCES",
    "EVALUATION_FREE",
    "LINKED_FROM_DATA",
    "apply_checkpoint_data",
    "apply_checkpoint_hparams",
    "apply_checkpoint_text_format",
    "check_config_classes",
    "check_config_files",
    "check_config_not_taken",
    "check_data_matches",
    "check_resumed_batch_size",
    "check_weights_fit",
    "check_writable_dir",
    "user_error",
    "weight_shapes",
]

LINKED_FROM_DATA = ("vocab_size", "pad_index", "level", "num_classes")
"""Model arguments the CLI links from the DataModule: checked against the data (:func:`check_data_matches`)."""

EVALUATION_FREE = ("lr", "weight_decay", "dropout", "recurrent_dropout", "init")
"""Hyperparameters that ``validate``/``test``/``predict --ckpt_path`` may set differently: evaluation does not read
them (dropout is off, the weights are loaded, no optimizer runs). ``fit`` accepts no difference at all: a resumed
run continues the same run, and Lightning would restore the optimizer's learning rate from the checkpoint anyway."""

DATA_SOURCES = ("path", "train_path", "val_path", "test_path", "predict_path", "dataset")
"""The data arguments that say where the text comes from. Evaluating a checkpoint, they are taken from it together,
and only when the command line names none of them: ``--data.test_path new.txt`` alone is the data (the checkpoint's
vocabulary reads it), not the training files plus it."""

STATE_SETUP = ("level", "unit", "window_length", "batch_size")
"""The data set-up a checkpoint's data state holds as the run resolved it (``level: null`` in the arguments is the
``char`` or ``word`` the run used); ``text_format`` is :func:`apply_checkpoint_text_format`'s."""

_SEQNORM_DIR = str(Path(__file__).resolve().parents[1])  # the seqnorm package, not seqnorm/cli


def _shown(value: Any) -> str:
    # as the value would be typed on the command line (jsonargparse reads JSON/YAML: null, true, {"a": 1})
    return json.dumps(value) if value is None or isinstance(value, (bool, dict, list)) else str(value)


def apply_checkpoint_hparams(
    model: Namespace, explicit: Namespace | None, hparams: dict[str, Any], subcommand: str, ckpt_path: str
) -> None:
    """Fill the parsed ``--model`` config with the checkpoint's hyperparameters, refusing contradicting flags.

    A hyperparameter the user set (on the command line or in a ``--config`` file: ``explicit``, parsed without
    defaults) must equal the checkpoint's, except the :data:`EVALUATION_FREE` ones outside ``fit``; every other
    one takes the checkpoint's value, so the config saved with the run (``config.yaml``) records what is used.
    Arguments linked from the data are left to :func:`check_data_matches`; names the model no longer takes are
    ignored, as Lightning's ``load_from_checkpoint`` does; renamed ones are read under their new names.
    """
    hparams = current_hparams(hparams)  # keys of before norm specs read as today's
    init_args = model.init_args
    given = explicit.get("init_args") if explicit is not None else None
    for name, saved in hparams.items():
        if name.startswith("_") or name in LINKED_FROM_DATA or name not in init_args:
            continue
        if name == "norm":
            saved = _norm_config(saved, f"--ckpt_path {ckpt_path}: hyper_parameters.norm")
        if given is None or name not in given:
            init_args[name] = saved
            continue
        value = given[name]
        if _same(name, value, saved) or (subcommand != "fit" and name in EVALUATION_FREE):
            continue
        if subcommand == "fit":
            keeps = "a resumed run keeps the checkpoint's model: drop the flag (or that line of the --config file)"
        else:
            keeps = (
                f"`{subcommand}` uses the checkpoint's model: drop the flag (or the --config file: the checkpoint "
                "supplies the model and the data set-up, so --ckpt_path and the new file, e.g. --data.test_path, are "
                "enough)"
            )
        config = run_config(ckpt_path)
        own = f", pass the run's own config (--config {config}, before --ckpt_path)" if config is not None else ""
        raise ValueError(
            f"--model.{name} {_shown(value)} contradicts the checkpoint {ckpt_path} ({name}={_shown(saved)}); "
            f"{keeps}{own}, or start a new run without --ckpt_path"
        )


def run_config(ckpt_path: str) -> str | None:
    """The ``config.yaml`` LightningCLI saved for the run a checkpoint belongs to (``<run>/config.yaml`` beside its
    ``checkpoints/`` folder, :func:`~seqnorm.cli.runs.checkpoint_run_dir`), as a path in the checkpoint path's terms;
    ``None`` when there is none."""
    run = checkpoint_run_dir(ckpt_path)
    config = run / "config.yaml" if run is not None else None
    return str(config) if config is not None and config.is_file() else None


def apply_checkpoint_data(
    data: Namespace | None, explicit: Namespace | None, checkpoint: dict[str, Any], data_state: Any, ckpt_path: str
) -> None:
    """Evaluating a checkpoint (``validate``/``test``/``predict``), fill the parsed ``--data`` config with the data
    set-up of the checkpoint's run, so that ``--ckpt_path`` and the new file are the whole command.

    What the user set (command line or ``--config``: ``explicit``) stays. The rest comes from the run's data
    arguments (:data:`~seqnorm.checkpoint_io.DATA_HPARAMS_KEY`, checked plain values) and, where the run
    resolved them (:data:`STATE_SETUP`), from its data state; the :data:`DATA_SOURCES` only when the user names none
    (``seqnorm test --ckpt_path X`` tests on the run's own test split). Never the settings of this machine
    (:data:`~seqnorm.data.base.LOCAL_SETTINGS`: the cache, a checksum to trust, worker processes), and a file only
    when it is a regular one, said once (:func:`~seqnorm.data.base.from_checkpoint`). The vocabulary and labels are
    loaded into the DataModule when it is made (``DataInstantiator``). Names the DataModule does not take are
    ignored.
    """
    init_args = data.get("init_args") if data is not None else None
    if init_args is None:
        return
    given = explicit.get("init_args") if explicit is not None else None
    given_names = set(vars(given)) if isinstance(given, Namespace) else set()
    user_sources = any(name in given_names for name in DATA_SOURCES)
    saved = {name: value for name, value in (checkpoint.get(DATA_HPARAMS_KEY) or {}).items() if name[:1] != "_"}
    if isinstance(data_state, dict):
        saved.update({name: data_state[name] for name in STATE_SETUP if data_state.get(name) is not None})
    wanted = {
        name: value
        for name, value in saved.items()
        if name in init_args and name not in given_names and not (user_sources and name in DATA_SOURCES)
    }
    for name, value in from_checkpoint(wanted, f"--ckpt_path {ckpt_path}").items():
        init_args[name] = value


def apply_checkpoint_text_format(
    data: Namespace | None, explicit: Namespace | None, data_state: Any, ckpt_path: str
) -> None:
    """Read the data as the checkpoint's run read it (``--data.text_format``, e.g. ``ptb_char``) unless the user
    named a format: a PTB-char file would otherwise stop at the plain-text check. A named format that differs from
    the checkpoint's is refused when the data state is loaded (``TextCorpus.load_state_dict``). A saved format that
    is none of :data:`TEXT_FORMATS` is a corrupt checkpoint (jsonargparse would dump its whole parse error)."""
    saved = data_state.get("text_format") if isinstance(data_state, dict) else None
    init_args = data.get("init_args") if data is not None else None
    if saved is None or init_args is None or "text_format" not in init_args:
        return  # an older checkpoint, or data without text formats (LabeledText)
    if not isinstance(saved, str) or saved not in TEXT_FORMATS:
        what = f"expected its {DATA_STATE_KEY}.text_format to be one of {', '.join(TEXT_FORMATS)}, got {saved!r}"
        raise corrupt_checkpoint(f"--ckpt_path {ckpt_path}", what)
    given = explicit.get("init_args") if explicit is not None else None
    if given is None or given.get("text_format") is None:
        init_args["text_format"] = checked_format(saved)  # a saved plain checks the new file's look


def _norm_config(saved: Any, owner: str) -> Any:
    """A saved ``norm`` as the parsed config writes it: a name as it is; a spec's plain data as a ``class_path``
    namespace whose class comes from seqnorm's registry (:func:`~seqnorm.norms.spec_from_dict`), not from the file.
    """
    if isinstance(saved, str):
        if saved not in NORMS:  # jsonargparse would read another string as a config file or a class name
            raise ValueError(f"{owner}: expected one of {', '.join(map(repr, NORMS))}, got {saved!r}")
        return saved
    spec = spec_from_dict(saved, owner)
    return Namespace(class_path=f"seqnorm.norms.{type(spec).__name__}", init_args=Namespace(**asdict(spec)))


def _as_spec(value: Any) -> Any:
    """A ``norm`` config value (a name, or a spec's ``class_path`` namespace) as the spec it makes, for comparing."""
    if isinstance(value, str) and value in NORMS:
        return NORMS[value].spec()
    if isinstance(value, NormSpec):
        return value
    if isinstance(value, Namespace) and isinstance(value.get("class_path"), str):
        for scheme in NORMS.values():
            if names_class(value.class_path, scheme.spec):
                init_args = value.get("init_args")
                return scheme.spec(**(vars(init_args) if init_args else {}))
    return value


def _same(name: str, value: Any, saved: Any) -> bool:
    # `--model.norm batch` means the spec the checkpoint saved as {"name": "batch", <defaults>}
    return value == saved or (name == "norm" and _as_spec(value) == _as_spec(saved))


def _data_flag(data: Namespace | None) -> str:
    init_args = data.get("init_args") if data is not None else None
    for name in ("dataset", "path", "train_path"):
        value = init_args.get(name) if init_args is not None else None
        if value:
            return f"--data.{name} {value}"
    return "the data (the embedded sample, no --data.path)"


def _few(tokens: list[str]) -> str:
    return ", ".join(repr(token) for token in tokens[:5]) + (", ..." if len(tokens) > 5 else "")


def check_data_matches(
    data_state: dict[str, Any] | None,
    datamodule: Any,
    hparams: dict[str, Any],
    model_hparams: Any,
    data: Namespace | None,
    ckpt_path: str,
) -> None:
    """Refuse data whose vocabulary (or labels) differ from the checkpoint's, before its weights are loaded.

    Without this the mismatch surfaces as a ``size mismatch for model.embedding.weight`` traceback, or, for two
    vocabularies of one size, as a model silently reading the wrong tokens.
    """
    flag = _data_flag(data)
    state = datamodule.state_dict() if data_state is not None and hasattr(datamodule, "state_dict") else {}
    saved_format, text_format = (data_state or {}).get("text_format"), state.get("text_format")
    if saved_format is not None and text_format is not None and saved_format != text_format:
        # said first: read in another format, the vocabulary differs too, and the format is what to change
        raise ValueError(
            f"{flag}: read with --data.text_format {text_format}, but the checkpoint {ckpt_path} was trained on "
            f"text read with --data.text_format {saved_format}: pass --data.text_format {saved_format} (or leave "
            "the flag out: a checkpoint's format applies by default)"
        )
    for key, what in (("vocab", "vocabulary"), ("labels", "labels")):
        saved, current = (data_state or {}).get(key), state.get(key)
        if saved is None or current is None:
            continue
        if key == "vocab":
            saved, current = saved.get("tokens"), current.get("tokens")
        if saved == current:
            continue
        only_data = [token for token in current if token not in set(saved)]
        only_checkpoint = [token for token in saved if token not in set(current)]
        detail = (
            f"only in the data: {_few(only_data) or 'none'}; only in the checkpoint: {_few(only_checkpoint) or 'none'}"
            if only_data or only_checkpoint
            else "the same entries in another order"
        )
        raise ValueError(
            f"{flag}: its {what} ({len(current)} entries) differs from the one the checkpoint {ckpt_path} was "
            f"trained with ({len(saved)} entries; {detail}); a checkpoint only reads data with its own {what}: "
            "pass the data it was trained on, or start a new run without --ckpt_path"
        )
    for name in LINKED_FROM_DATA:
        if name in hparams and name in model_hparams and hparams[name] != model_hparams[name]:
            raise ValueError(
                f"{flag}: gives {name}={model_hparams[name]}, but the checkpoint {ckpt_path} has "
                f"{name}={hparams[name]}; pass the data it was trained on, or start a new run without --ckpt_path"
            )


def weight_shapes(checkpoint: dict[str, Any], ckpt_path: str) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a checkpoint's ``state_dict``, for :func:`check_weights_fit`."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"--ckpt_path {ckpt_path}: expected a 'state_dict' of tensors, got {type(state).__name__}")
    return {key: tuple(value.shape) for key, value in state.items()}


def check_weights_fit(saved: dict[str, tuple[int, ...]], model: torch.nn.Module, ckpt_path: str) -> None:
    """Refuse a checkpoint whose weights do not fit the model its own hyperparameters build (a tensor missing, one
    too many or one of another shape: an edited or foreign file), as one message before Lightning's load_state_dict
    raises its traceback."""
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    problems = [f"missing {key}" for key in expected if key not in saved]
    problems += [f"unexpected {key}" for key in saved if key not in expected]
    problems += [
        f"{key} of shape {list(saved[key])} where the model has {list(shape)}"
        for key, shape in expected.items()
        if key in saved and saved[key] != shape
    ]
    if problems:
        raise ValueError(
            f"--ckpt_path {ckpt_path}: its weights do not fit the {type(model).__name__} its hyperparameters "
            f"describe ({'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}): pass a checkpoint "
            "written by `seqnorm fit` as it was"
        )


def check_resumed_batch_size(data_state: dict[str, Any] | None, datamodule: Any, ckpt_path: str) -> None:
    """Refuse to resume a ``fit`` with another ``--data.batch_size``: the checkpoint's data position counts batches
    of the size it was trained with (another size crashed in the sampler, or resumed silently elsewhere)."""
    saved = (data_state or {}).get("batch_size")  # checkpoints from before it was saved carry none
    current = getattr(datamodule, "batch_size", None)
    if saved is not None and current is not None and saved != current:
        raise ValueError(
            f"--data.batch_size {current}: the checkpoint {ckpt_path} was trained with --data.batch_size {saved}, "
            f"and a resumed fit continues that run's data order in batches of {saved}: pass --data.batch_size "
            f"{saved}, or start a new run without --ckpt_path"
        )


def check_config_files(argv: list[str]) -> None:
    """Each ``--config``/``-c`` file of ``argv`` reads as a YAML mapping; else a ``ValueError`` naming the flag and the
    file (jsonargparse's report of an undecodable, malformed or empty file named neither). A value that is no file is
    left to jsonargparse, which also reads YAML text given in place of a path and names a file that does not exist."""
    for _, flag, value, _ in config_values(argv):
        where = f"{flag} {value}"
        if not os.path.isfile(value):
            continue
        try:
            config = yaml.safe_load(Path(value).read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            byte = error.object[error.start]
            raise ValueError(f"{where}: not UTF-8 text (byte {byte:#04x} at offset {error.start})") from None
        except OSError as error:
            raise ValueError(f"{where}: cannot be read ({error.strerror or error})") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{where}: not YAML: {getattr(error, 'problem', None) or error}{at}") from None
        if not isinstance(config, dict):
            got = "an empty file" if config is None else f"a {type(config).__name__}"
            raise ValueError(f"{where}: expected a YAML mapping of sections (model:, data:, trainer:, ...), got {got}")
        check_config_classes(_with_included(config, [Path(value).parent, Path.cwd()]), where)


TRUSTED_ROOTS = ("seqnorm", "torch", "lightning")
"""The packages whose classes a ``--config`` file may name (``class_path``): seqnorm and the libraries it runs on.
``$SEQNORM_TRUSTED_MODULES`` (top-level names, comma-separated) adds packages of your own."""

# Where a config names a class by a plain dotted string (`optimizer: torch.optim.AdamW`), as jsonargparse reads it.
_CLASS_KEYS = frozenset(
    {"model", "data", "optimizer", "lr_scheduler"}
    | {f"trainer.{key}" for key in ("callbacks", "callbacks+", "logger", "strategy", "plugins", "profiler")}
)
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def trusted_roots() -> tuple[str, ...]:
    """:data:`TRUSTED_ROOTS` and those ``$SEQNORM_TRUSTED_MODULES`` adds."""
    extra = os.environ.get("SEQNORM_TRUSTED_MODULES", "")
    return TRUSTED_ROOTS + tuple(name.strip() for name in extra.split(",") if name.strip())


def _named_classes(config: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """``(key, class)`` for every class ``config`` names: each ``class_path``, and each dotted string where the
    sections of :data:`_CLASS_KEYS` take a class."""
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        if key == "class_path":
            yield where, value if isinstance(value, str) else repr(value)
        elif isinstance(value, str):  # `optimizer: torch.optim.AdamW`, an item of `trainer.callbacks`
            if (where in _CLASS_KEYS or path in _CLASS_KEYS) and _DOTTED.fullmatch(value):
                yield where, value
        else:
            yield from _named_classes(value, where)


_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _with_included(config: Any, folders: list[Path], depth: int = 0, top: bool = True) -> Any:
    """``config`` with every config file it names in its place, as jsonargparse reads them (``trainer: more.yaml``:
    a section, or a class's arguments, from another file), so that their classes are checked too. A file is one
    of YAML or JSON (or a top-level section's value), found beside the file naming it or in the working folder."""
    if isinstance(config, dict):
        return {key: _with_included(value, folders, depth, top=False) for key, value in config.items()}
    if isinstance(config, list):
        return [_with_included(item, folders, depth, top=False) for item in config]
    if not isinstance(config, str) or depth >= 8 or not (top or config.endswith(_CONFIG_SUFFIXES)):
        return config
    for folder in folders:
        path = folder / config
        try:
            if not path.is_file() or path.stat().st_size > 1 << 20:
                continue
            included = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):  # unreadable: jsonargparse's report then says so
            continue
        if isinstance(included, dict | list):
            return _with_included(included, [path.parent, *folders], depth + 1, top=False)
    return config


def check_config_classes(config: dict[str, Any], where: str) -> None:
    """Refuse a ``--config`` file that would make jsonargparse import a module outside :func:`trusted_roots` (to
    build a class it names: importing runs the module's code), or build a class from a model argument, which is a
    plain value (an ``Any``, such as ``rnn_options``, would build whatever it names). A config from elsewhere then
    runs no code of its own; a class of your own is named on the command line (``--trainer.callbacks+=my.Callback``),
    or its package is trusted with ``$SEQNORM_TRUSTED_MODULES``."""
    roots = trusted_roots()
    for key, named in _named_classes(config):
        root = named.partition(".")[0]
        if "." in named and root not in roots:
            raise ValueError(
                f"{where}: refused: {key} names {named!r}, outside {', '.join(roots)}; a config file imports no other "
                f"module (it would run that module's code): name the class on the command line, or trust its package "
                f"with SEQNORM_TRUSTED_MODULES={root}"
            )
    model = config.get("model")
    arguments = model.get("init_args", model) if isinstance(model, dict) else None
    if isinstance(arguments, dict):
        plain = {name: value for name, value in arguments.items() if name not in ("class_path", "init_args", "norm")}
        check_hyper_parameters(plain, f"{where}: model")


def check_writable_dir(value: str | None, flag: str = "--trainer.default_root_dir") -> None:
    """Refuse a log folder that cannot be created or written, before any data is read or step is trained."""
    if value is not None and "://" in value:  # a remote filesystem (fsspec): Lightning's logger checks it
        return
    directory = Path(value) if value else Path.cwd()
    named = f"{flag} {value}" if value else f"{flag} (not set, so the current directory {directory})"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ValueError(
            f"{named}: cannot write there ({error.strerror or error}); logs, config.yaml and checkpoints go there: "
            "pass a directory you can write to"
        ) from None


def check_config_not_taken(trainer: Trainer) -> None:
    """Refuse a run whose folder already holds another run's ``config.yaml``, before anything is written there.

    A new run's folder is claimed (:mod:`seqnorm.cli.runs`), but one it is given is not: ``--trainer.logger.version``,
    or a SLURM job's id, the version of every run of that job. Lightning's SaveConfigCallback refuses such a folder
    only as the run sets up, after the logger has written an event file into the other run's folder, with a
    ``RuntimeError`` traceback. A resumed fit continuing its own run overwrites its config.yaml (and is let through).
    """
    saver = next((callback for callback in trainer.callbacks if isinstance(callback, SaveConfigCallback)), None)
    if saver is None or saver.overwrite or not saver.save_to_log_dir or rank_zero_only.rank != 0:
        return
    log_dir = trainer.log_dir  # the folder SaveConfigCallback writes into; no logger has written yet
    if log_dir is None or "://" in log_dir or not (Path(log_dir) / saver.config_filename).is_file():
        return
    if os.path.basename(os.path.normpath(log_dir)) == SLURMEnvironment.job_id():
        remedy = "in a SLURM job every run's version is the job's id: give each run its own --trainer.default_root_dir"
    else:
        remedy = "leave --trainer.logger.version unset (each run then takes the next free version_N) or pass one free"
    taken = f"{log_dir} already holds a run ({saver.config_filename}), which this one would write into"
    raise ValueError(f"{taken}: {remedy}")


def _raised_in_seqnorm(traceback: TracebackType | None) -> bool:
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return os.path.abspath(traceback.tb_frame.f_code.co_filename).startswith(_SEQNORM_DIR + os.sep)


def user_error(error: ValueError) -> ValueError:
    """The error whose message to show: seqnorm's own, where a library wrapped it (``raise ... from``).

    jsonargparse reports a constructor's ValueError inside "Does not validate against any of the Union subtypes"
    with a dump of the whole config; the model's own sentence is the one that says what to change.
    """
    found, cause = error, error.__cause__
    while cause is not None:
        if isinstance(cause, ValueError) and _raised_in_seqnorm(cause.__traceback__):
            found = cause
        cause = cause.__cause__
    return found
