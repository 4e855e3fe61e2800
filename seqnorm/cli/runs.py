"""How the ``seqnorm`` command records a run: the model's hyperparameters, the run's directory
(``lightning_logs/<run name>/version_N``, named after what it trains) and the one a resumed fit continues.

Kept apart from :mod:`seqnorm.cli.app` so that the command itself stays a short list of LightningCLI hooks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.cli import LightningCLI, _InstantiatorFn
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from seqnorm.checkpoint_io import data_class, read_checkpoint, task_class
from seqnorm.layers import LAYERS, RecurrentLayer
from seqnorm.lightning import LanguageModel, SequenceClassifier
from seqnorm.lightning.atomic_io import is_disk_full, local_path

__all__ = [
    "EVALUATIONS",
    "LOGS_NAME",
    "DataInstantiator",
    "ModelInstantiator",
    "RunProgress",
    "checkpoint_run_dir",
    "claim_versions",
    "continued_run_logger",
    "disk_full_held_in_threads",
    "disk_full_message",
    "evaluation_logger",
    "flag_value",
    "release_unused_runs",
    "run_dir",
    "run_logger",
    "run_name",
    "with_checkpoint_model",
]

EVALUATIONS = ("validate", "test", "predict")
"""The subcommands that evaluate a checkpoint (a resumed ``fit`` trains on, and must read the same data)."""

LOGS_NAME = "lightning_logs"
"""The folder under ``--trainer.default_root_dir`` that holds the runs, ``<run name>/version_N`` each."""


def run_name(model: nn.Module, datamodule: Any = None) -> str | None:
    """What a run trains, as its folder under ``lightning_logs/`` names it: the task, the data, then
    ``<cell>-<norm>-h<hidden_size>``, ``-<N>layers`` for a stack and ``-bi`` for a bidirectional layer
    (``charlm-ptb.char.valid-lstm-layer-h128``, ``classifier-embedded-gru-batch-h64-2layers-bi``).

    The task is ``charlm`` or ``wordlm`` for a :class:`~seqnorm.lightning.LanguageModel` (by its level) and
    ``classifier`` for a :class:`~seqnorm.lightning.SequenceClassifier`, left out for another model; the data is
    the DataModule's ``source_name`` (a registered corpus's name, the first file's name, ``embedded``), left out
    without one. The cell is read from the first seqnorm layer in ``model`` (by its name in
    :data:`seqnorm.LAYERS`, the norm by its spec's registry name); ``None`` for a model without one. TensorBoard
    lists runs by folder, so a char LM and a word LM, or LN and BN runs of one task, read apart in its run list
    instead of as ``version_0``, ``version_1``.
    """
    layer = next((module for module in model.modules() if isinstance(module, RecurrentLayer)), None)
    if layer is None:
        return None
    cell = next(name for name, kind in LAYERS.items() if type(layer) is kind)
    parts = [cell, layer.norm_spec.name, f"h{layer.hidden_size}"]
    if layer.num_layers > 1:
        parts.append(f"{layer.num_layers}layers")
    if layer.bidirectional:
        parts.append("bi")
    source = getattr(datamodule, "source_name", None)
    if isinstance(source, str):
        parts.insert(0, source)
    if isinstance(model, LanguageModel):
        parts.insert(0, f"{model.hparams.level}lm")
    elif isinstance(model, SequenceClassifier):
        parts.insert(0, "classifier")
    return "-".join(parts)


def _logs_dir(default_root_dir: str | None) -> str:
    # Where the Trainer's default logger writes (its default_root_dir: the working directory, `~` expanded)
    root = default_root_dir if default_root_dir is not None else os.getcwd()
    local = local_path(root)
    return os.path.join(os.path.normpath(os.path.expanduser(local)) if local is not None else root, LOGS_NAME)


_CLAIMED: list[str] = []  # the run folders this process claimed (_claim_next) and has not released
_STARTED: set[str] = set()  # those of them whose run took its first step (RunProgress)
_MADE: list[str] = []  # the folders above them that claiming made (a new run name's), nearest first
_OPENED: list[str] = []  # every run folder this process writes into, claimed or continued, newest last


def _claim_version(parent: str) -> str | int | None:
    """A new run's ``version_N`` under ``parent``, claimed by creating its folder: ``os.mkdir`` fails where another
    process made it first (two runs started together in one folder both chose ``version_0``, and the second wrote an
    event file into the first's folder before dying on its ``config.yaml``), and this run takes the next number.
    ``None`` (Lightning numbers it, nothing created) on a process other than the global rank 0, whose folder rank 0
    chooses, and for a remote folder; a SLURM job's id as Lightning has it (a requeued job continues its folder)."""
    job = SLURMEnvironment.job_id()
    return job if job is not None else _claim_next(parent)


def _claim_next(parent: str, prefix: str = "version") -> int | None:
    """The next free ``<prefix>_N`` under ``parent``, its folder made by ``os.mkdir`` (:func:`_claim_version`)."""
    local = local_path(parent)  # a plain path, also for a file:// URL
    if rank_zero_only.rank != 0 or os.environ.get("NODE_RANK", "0") != "0" or local is None:
        return None
    nearest = Path(os.path.abspath(local))
    made = [str(folder) for folder in (nearest, *nearest.parents) if not folder.is_dir()]  # nearest first
    os.makedirs(local, exist_ok=True)
    _MADE.extend(made)
    number = _next_version(local, prefix)  # by the time of the mkdir below, another process may have taken it
    while True:
        folder = os.path.join(local, f"{prefix}_{number}")
        try:
            os.mkdir(folder)
        except FileExistsError:
            number += 1
            continue
        _CLAIMED.append(folder)
        return number


def _next_version(parent: str, prefix: str = "version") -> int:
    """One more than the highest ``<prefix>_N`` under ``parent`` (Lightning's numbering of ``version_N``), 0 for
    none."""
    taken = [entry[len(prefix) + 1 :] for entry in os.listdir(parent) if entry.startswith(f"{prefix}_")]
    return max((int(n) for n in taken if n.isdigit()), default=-1) + 1


class RunProgress(Callback):
    """Marks this process's new runs as started at their first step: the first training batch, or for an
    evaluation its first batch (the sanity check's validation batches are not one). A run that fails before
    that leaves nothing behind (:func:`release_unused_runs`)."""

    def _started(self, trainer: Any, *_: Any) -> None:
        if not trainer.sanity_checking:
            _STARTED.update(_CLAIMED)

    on_train_batch_end = on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _started


def release_unused_runs(failed: bool = False) -> None:
    """At the end of a command, remove the run folders this process claimed and did not use: an empty one (the
    command failed before its first write; ``os.rmdir`` removes only an empty folder), and, when the command
    ``failed``, one whose run never took its first step (:class:`RunProgress`): its ``config.yaml``,
    ``hparams.yaml`` and event files record a run that did not happen, and would be the next ``version_N`` a user
    opens. A folder claimed by this process holds only what this run wrote there. Then the folders that claiming
    made above them, where nothing else was written since (``os.rmdir``)."""
    while _CLAIMED:
        folder = _CLAIMED.pop()
        if failed and folder not in _STARTED:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    for folder in _MADE:  # then the folders made for them, now empty (a new run name's): nearest first
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    _MADE.clear()
    _STARTED.clear()


def run_logger(default_root_dir: str | None, name: str | None, version: str | None = None) -> TensorBoardLogger:
    """The ``seqnorm`` command's default logger: Lightning's (TensorBoard, a SLURM job's id as its version), writing
    into ``<default_root_dir>/lightning_logs/<name>/version_N`` (``lightning_logs/version_N`` when ``name`` is
    ``None``: Lightning's own layout), a new run's folder claimed at once (:func:`_claim_version`); ``version`` (a
    folder name) continues that run instead of numbering a new one."""
    name = name or ""
    parent = os.path.join(_logs_dir(default_root_dir), name)
    chosen = version or _claim_version(parent)
    logger = TensorBoardLogger(_logs_dir(default_root_dir), name=name, version=chosen)
    if chosen is not None:  # None: another process's folder, which Lightning's lazy numbering would only guess
        _OPENED.append(logger.log_dir)
    return logger


def claim_versions(loggers: Sequence[Any]) -> None:
    """Number the runs of the user's own loggers as :func:`run_logger` numbers the default one: a local
    TensorBoardLogger or CSVLogger whose ``version`` is unset gets the next ``version_N`` under its root directory,
    claimed (:func:`_claim_next`) before anything is written. Lightning numbers them only when they first write:
    two runs started together could both take ``version_0``, the second writing an event file into the first's
    folder before dying on its ``config.yaml``. Loggers with one root directory share one number, as Lightning's
    numbering gives them (a TensorBoard and a CSV log side by side in one ``version_N``)."""
    claimed: dict[str, int | None] = {}
    for logger in loggers:
        if not isinstance(logger, TensorBoardLogger | CSVLogger) or logger._version is not None:
            continue
        if logger.root_dir not in claimed:
            claimed[logger.root_dir] = _claim_next(logger.root_dir)
        if claimed[logger.root_dir] is not None:  # None: not global rank 0, or remote; Lightning numbers it
            logger._version = claimed[logger.root_dir]  # the attribute Lightning's `version` fills when first read
            _OPENED.append(logger.log_dir)


def run_dir(default_root_dir: str | None, name: str | None) -> str:
    """A new run's folder, numbered and claimed as :func:`run_logger` does: where a run without a logger keeps its
    config.yaml and checkpoints."""
    parent = os.path.join(_logs_dir(default_root_dir), name or "")
    # CSVLogger numbers runs as TensorBoardLogger does, without needing tensorboard
    folder = CSVLogger(_logs_dir(default_root_dir), name=name or "", version=_claim_version(parent)).log_dir
    _OPENED.append(folder)
    return folder


def disk_full_message(error: OSError) -> str:
    """One line for a full disk (or quota): where, what to free, and that the last complete checkpoint is kept
    (checkpoints are written to a temporary file and renamed: a failed write leaves the previous one)."""
    run = _OPENED[-1] if _OPENED else None  # the run this process opened last
    where = os.path.dirname(error.filename) if isinstance(error.filename, str) else run or os.getcwd()
    message = (
        f"no space left on the device of {where} ({error.strerror}): free space there (older runs under "
        f"{LOGS_NAME}/, their checkpoints/ folders) or pass --trainer.default_root_dir on a disk with room"
    )
    last = Path(run, "checkpoints", "last.ckpt") if run is not None else None
    if last is not None and last.is_file():
        return f"{message}; the last complete checkpoint is kept: resume with --ckpt_path {last}"
    return f"{message}; no checkpoint was lost (a write that fails leaves the previous file)"


_HELD: list[BaseException] = []  # full-disk errors of this process's threads, kept quiet for the command to report
_SETTLED: list[BaseException] = []  # full-disk errors the command ended with (and reported)
_running = False  # whether a command is in disk_full_held_in_threads
_thread_hook: Callable[[threading.ExceptHookArgs], Any] = threading.excepthook  # the hook ours hands the rest to


def _hold_disk_full(args: threading.ExceptHookArgs) -> None:
    error = args.exc_value
    if error is not None and is_disk_full(error) and (_running or any(error is done for done in _SETTLED)):
        _HELD.append(error)
        return
    _thread_hook(args)


@contextlib.contextmanager
def disk_full_held_in_threads() -> Iterator[None]:
    """Around a command: a full disk met in one of its background threads is the command's to report, once.

    TensorBoard's event writer writes in a thread, and hands the thread's error to the next write, flush or close,
    whose OSError the command reports in one line (:func:`disk_full_message`); the thread also raised it, and
    ``threading.excepthook`` printed its traceback after that line, cut short by the exit. Here that traceback is
    held (before the command's report, or after it, for the error reported); one held while the command ended
    without an error is raised at the end, and reported the same way. Other errors reach the previous hook."""
    global _running, _thread_hook
    if threading.excepthook is not _hold_disk_full:
        _thread_hook, threading.excepthook = threading.excepthook, _hold_disk_full
    _HELD.clear()
    _running = True
    try:
        try:
            yield
        finally:
            _running = False
        if _HELD:  # a thread's full disk that nothing handed back: the run's logs are incomplete
            raise _HELD[0]
    except OSError as error:
        if is_disk_full(error):
            _SETTLED.append(error)
        raise


def checkpoint_run_dir(ckpt_path: str | None) -> Path | None:
    """The run directory a local checkpoint was saved in by the default checkpoint callback: the folder holding its
    ``checkpoints/`` (``lightning_logs/<run name>/version_N``, or ``lightning_logs/version_N`` for runs of before
    the runs were named), where that run's ``config.yaml`` is, as a path in the checkpoint path's terms (relative
    if it is); ``None`` for a checkpoint anywhere else. The one place that knows where a run keeps its checkpoints."""
    local = local_path(ckpt_path) if ckpt_path is not None else None
    if ckpt_path is None or local is None:
        return None
    checkpoint = Path(local if "://" in ckpt_path else ckpt_path)  # the user's terms; local_path's is absolute
    if not checkpoint.is_file() or checkpoint.parent.name != "checkpoints":
        return None
    return checkpoint.parent.parent


class ModelInstantiator(_InstantiatorFn):
    """LightningCLI's model instantiator (it hands ``save_hyperparameters()`` the parsed config, so that checkpoints
    record the ``class_path``), recording only the linked values that reached the constructor.

    The CLI links ``data.level`` to ``model.init_args.level`` (and ``data.num_classes`` to ``num_classes``): where
    the chosen model has no such argument, jsonargparse skips the link but still lists it as applied, and Lightning
    writes every listed link into the hyperparameters. A SequenceClassifier checkpoint then held ``level``, which
    its constructor does not take, and every reader that builds the model from the saved hyperparameters with
    jsonargparse (LightningCLI's own ``--ckpt_path``, ``LightningModule.load_from_checkpoint``) failed with
    "unexpected keyword argument 'level'". A link reached the constructor when its argument is among the keyword
    arguments jsonargparse passes.
    """

    def __init__(self, cli: LightningCLI) -> None:
        super().__init__(cli=cli, key="model")

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        prefix = f"{self.key}.init_args."
        reached = {
            target: value
            for target, value in applied_instantiation_links.items()
            if not target.startswith(prefix) or target[len(prefix) :].partition(".")[0] in kwargs
        }
        return super().__call__(class_type, *args, applied_instantiation_links=reached, **kwargs)


class DataInstantiator(_InstantiatorFn):
    """LightningCLI's data instantiator, which hands the new DataModule to ``adopt`` before anything reads it.

    Evaluating a checkpoint, the CLI gives the DataModule the checkpoint's vocabulary (and labels) there, before the
    model's linked sizes are read from it. A DataModule builds its vocabulary from its training split, which
    depends on more than the checkpoint's corpus: with ``--data.test_path new.txt`` nothing is carved off
    ``--data.path`` for testing, so the training split grows and its vocabulary comes out in another order. A
    resumed ``fit`` keeps the strict comparison (``check_data_matches``): it trains on, and must read the same data.
    """

    def __init__(self, cli: LightningCLI, adopt: Callable[[Any], None]) -> None:
        super().__init__(cli=cli, key="data")
        self.adopt = adopt

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        datamodule = super().__call__(
            class_type, *args, applied_instantiation_links=applied_instantiation_links, **kwargs
        )
        self.adopt(datamodule)
        return datamodule


def _run_of(ckpt_path: str | None, default_root_dir: str | None) -> tuple[str, str | None, str] | None:
    """Where the run a checkpoint belongs to is, when ``ckpt_path`` is a local file in the layout the default logger
    writes under this run's root directory, ``<default_root_dir>/lightning_logs/<run name>/<version>/checkpoints/
    <file>`` (or, from before runs were named, ``lightning_logs/<version>/checkpoints/<file>``): the root
    directory, the run's name (``None`` for the unnamed layout) and its version folder. ``None`` for a checkpoint
    anywhere else, e.g. one kept outside the run folders or written under another ``--trainer.default_root_dir``."""
    run = checkpoint_run_dir(ckpt_path)
    root = default_root_dir if default_root_dir is not None else os.getcwd()
    if run is None or local_path(root) is None:  # remote paths: Lightning's default
        return None
    logs, run = Path(_logs_dir(root)).resolve(), run.resolve()
    if run.parent == logs:
        return root, None, run.name
    if run.parent.parent == logs:
        return root, run.parent.name, run.name
    return None


def continued_run_logger(ckpt_path: str | None, default_root_dir: str | None) -> TensorBoardLogger | None:
    """The default logger (:func:`run_logger`), writing into the run a checkpoint belongs to (:func:`_run_of`).

    The resumed fit then adds to that run's TensorBoard curves, ``config.yaml`` and top-k checkpoints instead of
    opening ``version_N+1``. ``None`` (a new run) for a checkpoint elsewhere. A run folder moved or copied into
    ``lightning_logs/`` continues too (:class:`~seqnorm.lightning.checkpoint.ResumableCheckpoint` rebases its saved
    state).
    """
    found = _run_of(ckpt_path, default_root_dir)
    if found is None:
        return None
    root, name, version = found
    # The same paths as the first run's, so ModelCheckpoint recognizes its saved dirpath and restores its top-k state.
    return run_logger(root, name, version=version)


def evaluation_logger(ckpt_path: str | None, default_root_dir: str | None, subcommand: str) -> TensorBoardLogger | None:
    """The default logger of ``validate``/``test``/``predict`` on a checkpoint of a run (:func:`_run_of`): beside
    the training run, inside its folder, as ``<run>/<subcommand>_N`` (``lightning_logs/charlm-...-h128/version_0/
    test_0``), claimed as a new run's folder is. Its ``config.yaml``, metrics and predictions are the evaluation's,
    and TensorBoard lists it under the run it evaluates. ``None`` (a new run of its own) for a checkpoint
    elsewhere."""
    found = _run_of(ckpt_path, default_root_dir)
    if found is None:
        return None
    root, name, version = found
    run = os.path.join(_logs_dir(root), name or "", version)
    number = _claim_next(run, subcommand)
    # None: not global rank 0, whose logger writes nothing (Lightning's numbering is only a placeholder there)
    logger = TensorBoardLogger(run, name="", version=f"{subcommand}_{number}" if number is not None else None)
    if number is not None:
        _OPENED.append(logger.log_dir)
    return logger


_RUN_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_CONFIG_FLAGS = ("--config", "-c")


def flag_value(argv: object, flag: str) -> str | None:
    """The value ``flag`` has in a command line (``--flag value`` or ``--flag=value``); ``None`` when absent or
    when ``argv`` is not a list of strings (the CLI given a config dict)."""
    if not isinstance(argv, list | tuple):
        return None
    for index, argument in enumerate(argv):
        if argument == flag and index + 1 < len(argv):
            return argv[index + 1]
        if argument.startswith(f"{flag}="):
            return argument.partition("=")[2]
    return None


def with_checkpoint_model(argv: Sequence[str], models: Sequence[type], datamodules: Sequence[type]) -> list[str]:
    """``argv`` with ``--model <the checkpoint's class>`` added where a run subcommand has ``--ckpt_path`` but
    names no model (no ``--model``, no ``--config`` that could), and for :data:`EVALUATIONS` ``--data <the class the
    run read its data with>`` likewise.

    ``seqnorm test --ckpt_path X --data.test_path new.txt`` then evaluates the checkpoint's model on data made as
    the run made it (the CLI fills in the rest of the set-up, :func:`~seqnorm.cli.checks.apply_checkpoint_data`),
    as ``load_from_checkpoint`` would, instead of stopping at a missing ``--model`` or an unaccepted
    ``--data.test_path``. The checkpoint is read safely (``weights_only``) and its classes must be among ``models``
    and ``datamodules``; a resumed ``fit`` names its data itself.
    """
    arguments = list(argv)
    if not arguments or arguments[0] not in _RUN_SUBCOMMANDS:
        return arguments
    ckpt_path = flag_value(arguments, "--ckpt_path")
    flags = {argument.partition("=")[0] for argument in arguments}
    wanted = {"--model", "--data"} if arguments[0] in EVALUATIONS else {"--model"}
    if ckpt_path is None or flags & set(_CONFIG_FLAGS) or wanted <= flags:
        return arguments
    checkpoint = read_checkpoint(ckpt_path)
    added = []
    saved_class = task_class(checkpoint, models, ckpt_path)
    if "--model" not in flags:
        if saved_class is None:  # not written by seqnorm's CLI (trainer.save_checkpoint from Python, say)
            names = " or ".join(f"--model {model.__name__}" for model in models)
            raise ValueError(
                f"--ckpt_path {ckpt_path}: the checkpoint names no model class (it was not written by `seqnorm fit`):"
                f" pass {names}"
            )
        added += ["--model", saved_class.__name__]
    saved_data = data_class(checkpoint, datamodules, ckpt_path) if "--data" in wanted - flags else None
    if saved_data is not None:
        added += ["--data", saved_data.__name__]
    return [arguments[0], *added, *arguments[1:]]
