"""The ``seqnorm`` command: LightningCLI's ``fit``, ``validate``, ``test``, ``predict``, plus ``generate`` and
``configs`` (the shipped config files).

Examples::

    seqnorm fit --model LanguageModel --data TextCorpus --data.path my.txt --model.norm layer
    seqnorm fit --config configs/char_lm.yaml --config configs/norm/batch.yaml --data.path my.txt
    seqnorm fit ... --ckpt_path lightning_logs/charlm-my-lstm-layer-h256/version_0/checkpoints/last.ckpt  # resumes it
    seqnorm predict --ckpt_path lightning_logs/charlm-my-lstm-layer-h256/version_0/checkpoints/last.ckpt  # predict_0/
    seqnorm generate --ckpt_path lightning_logs/charlm-my-lstm-layer-h256/version_0/checkpoints/last.ckpt

Each run gets ``lightning_logs/<run name>/version_N``, named after what it trains (:func:`seqnorm.cli.runs.run_name`);
``validate``/``test``/``predict`` of its checkpoint write beside it, into ``version_N/<subcommand>_K`` (a prediction
run's ``predictions.jsonl`` too).

User errors (a missing file, bad text, an impossible setting, a checkpoint that is not one) end with a
one-paragraph message and exit code 2, not a traceback; set ``SEQNORM_DEBUG=1`` to see the traceback.

Checkpoints are untrusted input: every one is read with ``torch.load(weights_only=True)`` (see
:mod:`seqnorm.checkpoint_io`), and with ``--ckpt_path`` the checkpoint's model hyperparameters are used
(a flag that contradicts them is an error, see :mod:`seqnorm.cli.checks`); ``validate``, ``test`` and ``predict``
also take the data set-up from it (class, vocabulary, format, level, unit, sizes), so the new file is all they need::

    seqnorm test --ckpt_path lightning_logs/charlm-my-lstm-layer-h256/version_0/checkpoints/last.ckpt \
        --data.test_path new.txt
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import warnings
from typing import Any, ClassVar

import torch
from jsonargparse import Namespace, auto_cli
from jsonargparse.typing import NonNegativeInt
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from seqnorm.checkpoint_io import (
    ALLOWED_GLOBALS,
    CheckedCheckpointIO,
    corrupt_checkpoint,
    data_class,
    names_class,
    read_checkpoint,
    task_class,
)
from seqnorm.cli.checks import (
    apply_checkpoint_data,
    apply_checkpoint_hparams,
    apply_checkpoint_text_format,
    check_config_files,
    check_config_not_taken,
    check_data_matches,
    check_resumed_batch_size,
    check_weights_fit,
    check_writable_dir,
    user_error,
    weight_shapes,
)
from seqnorm.cli.commands import answer_without_lightning
from seqnorm.cli.flags import FlagSuggestingParser, FunctionFlagParser
from seqnorm.cli.output import in_command_line_words, quiet_known_noise, show_generated
from seqnorm.cli.runs import (
    EVALUATIONS,
    DataInstantiator,
    ModelInstantiator,
    RunProgress,
    claim_versions,
    continued_run_logger,
    disk_full_held_in_threads,
    disk_full_message,
    evaluation_logger,
    flag_value,
    release_unused_runs,
    run_logger,
    run_name,
    with_checkpoint_model,
)
from seqnorm.cli.threads import THREADS_HELP, configure_threads
from seqnorm.cli.trainer import adjust_trainer_config
from seqnorm.data import LabeledText, TextCorpus, Vocabulary
from seqnorm.data.units import UNITS
from seqnorm.lightning import LanguageModel, SequenceClassifier, SyncBatchNorm
from seqnorm.lightning.base import DATA_STATE_KEY
from seqnorm.lightning.generate import SAMPLING_MINIMUMS, generate_text, sampling_out_of_range
from seqnorm.lightning.prediction_writer import PredictionWriter
from seqnorm.shipped_configs import resolve_config_names

__all__ = ["PRIVATE_OVERRIDES", "SIGTERM_EXIT_CODE", "SeqnormCLI", "generate", "main"]

PRIVATE_OVERRIDES = ("_parse_ckpt_path",)
"""The private LightningCLI methods :class:`SeqnormCLI` still overrides, where Lightning offers no public hook (the
comment at the definition says why); everything else goes through public ones: ``__init__`` (predict's
``parser_kwargs``, the context the run happens in), ``add_arguments_to_parser``, ``parse_arguments``,
``before_instantiate_classes``, ``instantiate_trainer``, ``after_instantiate_classes`` and ``before_fit``. A Lightning
upgrade checks these first (``tests/cli/test_cli_conventions.py`` fails when one is no longer LightningCLI's), then
the two private names seqnorm uses without overriding them: ``LightningCLI._get`` and ``_InstantiatorFn``
(subclassed in :mod:`seqnorm.cli.runs`)."""

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a run stopped by SIGTERM (after saving last.ckpt): the shell's code for "terminated by SIGTERM"."""

# Registered for `--model NAME` / `--data NAME` (LightningCLI's subclass mode resolves short names of imported
# subclasses); listed here so that importing this module is what makes them available.
MODELS = (LanguageModel, SequenceClassifier)
DATAMODULES = (TextCorpus, LabeledText)

DEFAULT_CALLBACKS: list[dict[str, Any]] = [
    {  # best by validation loss, plus last.ckpt (also written on an exception or interrupt) for --ckpt_path resume
        "class_path": "seqnorm.lightning.checkpoint.ResumableCheckpoint",
        "init_args": {
            "monitor": "val/loss",
            "mode": "min",
            "filename": "best-{epoch}-{step}",
            "save_last": True,
            "save_on_exception": True,
        },
    },
]
PREDICT_CALLBACKS: list[dict[str, Any]] = [
    *DEFAULT_CALLBACKS,
    # One JSON line per input in the run directory (lightning_logs/<run name>/version_N/predict_K/predictions.jsonl).
    {"class_path": "seqnorm.lightning.prediction_writer.PredictionWriter"},
]
# The progress bar is not listed here but added when the Trainer is built (seqnorm.cli.trainer: a RichProgressBar
# without "Epoch 0/-2"), so `--trainer.enable_progress_bar false` still works; so does
# `--trainer.enable_checkpointing false`, which drops the checkpoint callback above.


class _Parser(FlagSuggestingParser):
    nested_classes: ClassVar[dict[str, tuple[type, ...]]] = {"model": MODELS, "data": DATAMODULES}

    def __init__(self, *args: Any, default_callbacks: list[dict[str, Any]] = DEFAULT_CALLBACKS, **kwargs: Any):
        # the --trainer.callbacks default of this parser's subcommand, set in SeqnormCLI.add_arguments_to_parser:
        # LightningCLI makes each subcommand's parser with that subcommand's parser_kwargs (predict's: SeqnormCLI)
        super().__init__(*args, **kwargs)
        self.default_callbacks = default_callbacks


class SeqnormCLI(LightningCLI):
    """LightningCLI with the sizes that come from the data linked into the model (never typed twice).

    With ``--ckpt_path`` the checkpoint is read safely and checked before anything is built: its class must be one
    of :data:`MODELS`, its hyperparameters fill in the model flags the user did not set (one that contradicts
    them is an error), and the data's vocabulary must be the checkpoint's. Evaluating it, the run's data set-up
    fills in the data flags the user did not set (its class one of :data:`DATAMODULES`). The file is read once: the
    Trainer restores the weights and the loops' state from that checked read (:class:`CheckedCheckpointIO`), never
    from a second read of the path, and is given ``weights_only=True`` as well.
    """

    _args: ArgsType = None
    _resumed: dict[str, Any] | None = None  # the checked checkpoint's hyper_parameters and data state
    _checked: tuple[str, dict[str, Any]] | None = None  # --ckpt_path and the checkpoint read from it, checked
    _continues_run = False  # a resumed fit logging into its checkpoint's run directory (continued_run_logger)

    def __init__(
        self,
        *args: Any,
        parser_class: type[LightningArgumentParser] = _Parser,
        parser_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        parser_kwargs = dict(parser_kwargs or {})
        # predict's own --trainer.callbacks default (_Parser), which --trainer.callbacks replaces and += adds to
        parser_kwargs["predict"] = {"default_callbacks": PREDICT_CALLBACKS, **parser_kwargs.get("predict", {})}
        # LightningCLI parses, builds and runs the subcommand within __init__, so the run happens inside these: the
        # allow-list for a checkpoint Lightning would read itself (read_checkpoint uses the same one), and warnings
        # filters that last the run only (before_fit's)
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            # a mistyped flag gets a "did you mean", also among the arguments of the --model/--data class (cli.flags)
            super().__init__(*args, parser_class=parser_class, parser_kwargs=parser_kwargs, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # set_defaults, not trainer_defaults: it parses class_path dicts (and `--trainer.callbacks+=X` appends)
        # seqnorm's batch samplers shard themselves across processes (seqnorm.data.sampler); Lightning's
        # DistributedSampler injection cannot wrap a batch sampler.
        callbacks = parser.default_callbacks  # DEFAULT_CALLBACKS, predict's parser PREDICT_CALLBACKS (_Parser)
        parser.set_defaults({"trainer.callbacks": callbacks, "trainer.use_distributed_sampler": False})
        # Each link applies where both ends exist: level -> LanguageModel, num_classes -> SequenceClassifier.
        for source, target in (
            ("data.vocab_size", "model.init_args.vocab_size"),
            ("data.pad_index", "model.init_args.pad_index"),
            ("data.level", "model.init_args.level"),
            ("data.num_classes", "model.init_args.num_classes"),
        ):
            parser.link_arguments(source, target, apply_on="instantiate")
        parser.add_argument("--threads", type=NonNegativeInt | None, default=None, help=THREADS_HELP)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        self._args = args  # parsed again without defaults to tell the flags the user set (_parse_ckpt_path)
        super().parse_arguments(parser, args)

    # Private: it replaces LightningCLI's own, which parses the checkpoint's hyperparameters *over* the user's flags
    # (so a contradicting flag is silently dropped) and imports whatever class its `_class_path` names. __init__
    # calls it right after parse_arguments: work done in a public hook would still be followed by Lightning's.
    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        if config.get("weights_only") is False:
            raise ValueError(
                "--weights_only false: refused: seqnorm loads checkpoints with weights_only=True only, since "
                "unpickling anything else can run code; checkpoints written by `seqnorm fit` need nothing more"
            )
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None:
            typed = flag_value(sys.argv[1:] if self._args is None else self._args, "--ckpt_path")
            if isinstance(typed, str) and typed != "null":
                # A run's config.yaml records `ckpt_path: null`: given after --ckpt_path, it silently evaluated (or
                # trained) a fresh model.
                raise ValueError(
                    f"--ckpt_path {typed}: reset to null by a --config file given after it (a run's config.yaml "
                    "records ckpt_path: null): put --ckpt_path after --config"
                )
            return
        checkpoint = read_checkpoint(ckpt_path)
        self._checked = (ckpt_path, checkpoint)  # what the Trainer restores (CheckedCheckpointIO): no second read
        saved_class = task_class(checkpoint, MODELS, ckpt_path)
        model = config.model
        if saved_class is not None and not names_class(model.class_path, saved_class):
            raise ValueError(
                f"--model {model.class_path.rpartition('.')[2]} contradicts the checkpoint {ckpt_path}, which holds "
                f"a {saved_class.__name__}: pass --model {saved_class.__name__}"
            )
        hparams = checkpoint["hyper_parameters"]
        explicit = self._explicit_config()[subcommand]
        apply_checkpoint_hparams(model, explicit.get("model"), hparams, subcommand, ckpt_path)
        data_state = checkpoint.get(DATA_STATE_KEY)
        if subcommand in EVALUATIONS:
            self._apply_checkpoint_data(config.get("data"), explicit.get("data"), checkpoint, data_state, ckpt_path)
        try:  # the values just taken from the checkpoint (the user's were checked when parsed)
            self.parser.validate(self.config)
        except (TypeError, KeyError, argparse.ArgumentError) as error:
            detail = " ".join(str(error).split())
            described = model.class_path.rpartition(".")[2]
            what = f"its hyper_parameters do not describe a {described} ({detail})"
            raise corrupt_checkpoint(f"--ckpt_path {ckpt_path}", what) from None
        apply_checkpoint_text_format(config.get("data"), explicit.get("data"), data_state, ckpt_path)
        shapes = weight_shapes(checkpoint, ckpt_path)
        self._resumed = {"hparams": hparams, "data_state": data_state, "path": ckpt_path, "shapes": shapes}

    def _apply_checkpoint_data(
        self, data: Any, explicit: Any, checkpoint: dict[str, Any], data_state: Any, ckpt_path: str
    ) -> None:
        saved_class = data_class(checkpoint, DATAMODULES, ckpt_path)
        class_path = data.get("class_path") if data is not None else None
        if saved_class is None or class_path is None:
            return
        if not names_class(class_path, saved_class):
            raise ValueError(
                f"--data {class_path.rpartition('.')[2]} contradicts the checkpoint {ckpt_path}, whose run read "
                f"its data with {saved_class.__name__}: pass --data {saved_class.__name__} (or leave --data out: the "
                "checkpoint supplies it)"
            )
        apply_checkpoint_data(data, explicit, checkpoint, data_state, ckpt_path)

    def _explicit_config(self) -> Any:
        """The config with only what the command line and ``--config`` files set (no defaults)."""
        if isinstance(self._args, dict | Namespace):
            return self.parser.parse_object(self._args, defaults=False)
        return self.parser.parse_args(self._args, defaults=False)

    def _adopt_checkpoint_data(self, datamodule: LightningDataModule) -> None:
        """Evaluating a checkpoint (:data:`EVALUATIONS`), give the DataModule the vocabulary and labels saved in it."""
        state = (self._resumed or {}).get("data_state")
        if state is None or self.subcommand not in EVALUATIONS or not hasattr(datamodule, "load_state_dict"):
            return
        try:
            datamodule.load_state_dict(state)
        except ValueError as error:  # DataError included: a corrupt or contradicted saved state
            raise ValueError(f"--ckpt_path {self._resumed['path']}: {error}") from None

    def before_instantiate_classes(self) -> None:
        if self.subcommand is not None and self._get(self.config, "data") is None:
            # the model would be built without the vocabulary size the data links to it: jsonargparse's report of
            # that (`empty(): argument 'size' ... NoneType`, then every model argument) named no flag
            names = " or ".join(f"--data {cls.__name__}" for cls in DATAMODULES)
            raise ValueError(
                f"--data: no data given: name its class, {names}, then its files (`seqnorm {self.subcommand} "
                f"--data.help {DATAMODULES[0].__name__}` lists its flags)"
            )
        # Lightning added its instantiators just before this hook; these replace them (same keys): see
        # ModelInstantiator for the hyperparameter Lightning's recorded, and DataInstantiator for the vocabulary a
        # checkpoint's data takes.
        self.parser.add_instantiator(ModelInstantiator(self), LightningModule, subclasses=True)
        self.parser.add_instantiator(
            DataInstantiator(self, self._adopt_checkpoint_data), LightningDataModule, subclasses=True
        )
        # Instantiating reads (and may download) the data: an unusable log folder should stop the run first.
        trainer = self._get(self.config, "trainer")
        check_writable_dir(trainer.get("default_root_dir") if trainer is not None else None)
        configure_threads(self._get(self.config, "threads"))  # before the data and the model touch torch
        if self._get(self.config, "lr_scheduler") and not self._get(self.config, "optimizer"):
            # LightningCLI attaches a scheduler only to an optimizer it builds; the modules' own Adam ran without it.
            raise ValueError(
                "--lr_scheduler: needs --optimizer too (a scheduler alone was silently ignored): pass e.g. "
                "--optimizer Adam --optimizer.lr 0.002 (then --model.lr and --model.weight_decay are not used)"
            )

    def after_instantiate_classes(self) -> None:
        if self._resumed is not None:  # before Lightning loads the weights into a model built for other data
            check_data_matches(
                self._resumed["data_state"],
                self.datamodule,
                self._resumed["hparams"],
                self.model.hparams,
                self._get(self.config, "data"),
                self._resumed["path"],
            )
            check_weights_fit(self._resumed["shapes"], self.model, self._resumed["path"])
            if self.subcommand == "fit":
                check_resumed_batch_size(self._resumed["data_state"], self.datamodule, self._resumed["path"])
            self._resumed = None
        if self.subcommand is not None:
            # The Trainer method is given its arguments from config_init (config.yaml keeps the user's value, null):
            # Lightning's default weights_only for a local file is False, an unpickling that can run code.
            self.config_init[self.subcommand]["weights_only"] = True

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        name = run_name(self.model, self.datamodule)
        adjust_trainer_config(config, name)  # enable_checkpointing false, logger false, the progress bar (cli.trainer)
        # --trainer.sync_batchnorm true: seqnorm's per-timestep BN too, through Lightning's LayerSync mechanism.
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if config.get("sync_batchnorm") and not any(isinstance(plugin, LayerSync) for plugin in plugins):
            config["plugins"] = [*plugins, SyncBatchNorm()]
        # The default logger is Lightning's, in a folder named after what the run trains (cli.runs.run_logger). A
        # resumed fit continues its run directory: one TensorBoard run, one version_N. validate/test/predict of a
        # run's checkpoint write beside it, into <run>/<subcommand>_N: their config.yaml, metrics and predictions.
        if config.get("logger") in (None, True) and not config.get("barebones"):  # barebones refuses any logger
            root = config.get("default_root_dir")
            ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand is not None else None
            logger = None
            if self.subcommand == "fit":
                logger = continued_run_logger(ckpt_path, root)
            elif self.subcommand in EVALUATIONS:
                logger = evaluation_logger(ckpt_path, root, self.subcommand)
            if self.subcommand == "fit" and logger is not None:
                self._continues_run = True
                # config.yaml is there already: it becomes the resumed run's (Lightning refuses to overwrite it)
                self.save_config_kwargs = {**self.save_config_kwargs, "overwrite": True}
            config["logger"] = logger if logger is not None else run_logger(root, name)
        else:  # the user's own loggers, numbered and claimed as the default one is
            claim_versions(config["logger"] if isinstance(config.get("logger"), list | tuple) else [config["logger"]])
        given = config.get("callbacks") or []
        callbacks = list(given) if isinstance(given, list | tuple) else [given]
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in callbacks):
            # A callbacks list replaced predict's default (a fit run's config.yaml lists fit's callbacks): without
            # a writer, predict would compute every prediction and write none.
            callbacks.append(PredictionWriter())
        config["callbacks"] = [*callbacks, RunProgress()]  # a run failing before its first step leaves no folder
        interval = config.get("val_check_interval")
        if isinstance(interval, int) and not isinstance(interval, bool) and interval == 0:  # Lightning divides by it
            raise MisconfigurationException(
                "--trainer.val_check_interval 0: expected a number of training steps (1 or more) or a fraction of an "
                "epoch (0.0 to 1.0)"
            )
        try:
            trainer = super().instantiate_trainer(**config)
        except TypeError as error:  # Lightning's word for a setting of the wrong kind (`--trainer.devices -3`)
            raise MisconfigurationException(f"--trainer: {error}") from error
        check_config_not_taken(trainer)  # a folder given, not claimed: another run's? Before its logger writes there
        if self._checked is not None:  # the Trainer restores the checkpoint that was checked, not a new read
            path, checkpoint = self._checked
            trainer.strategy.checkpoint_io = CheckedCheckpointIO(path, checkpoint, trainer.strategy.checkpoint_io)
        return trainer

    def before_fit(self) -> None:
        # ModelCheckpoint warns of a non-empty folder: a resumed run's own. The filter ends with __init__'s context.
        if self._continues_run:
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")


def generate(
    *,
    ckpt_path: str,
    prompt: str = "",
    length: int = 200,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
) -> str:
    """Continue ``prompt`` with text sampled from a LanguageModel checkpoint, one token at a time at batch size 1.

    Returns the prompt as given, then the continuation (after a space where the model reads words and the prompt
    does not end in one), so the result reads as one text: ``text[len(prompt):]`` is what the model wrote.

    Args:
        ckpt_path: a checkpoint written by ``seqnorm fit --model LanguageModel`` (e.g. ``.../last.ckpt``).
        prompt: text to continue (tokenized like the training data; unknown tokens become <unk>).
        length: number of tokens to generate.
        temperature: sampling temperature; 0 for greedy decoding.
        top_k: sample only among the k most likely tokens.
        seed: random seed for reproducible samples.
    """
    wrong = sampling_out_of_range(length, temperature, top_k)  # named by flag here, before reading the checkpoint
    if wrong is not None:
        name, value = wrong
        kind = "a finite value" if name == "temperature" else "an int"
        greedy = " (0: greedy)" if name == "temperature" else ""
        raise ValueError(f"--{name} {value}: expected {kind} >= {SAMPLING_MINIMUMS[name]}{greedy}")
    checkpoint = read_checkpoint(ckpt_path)
    saved_class = task_class(checkpoint, MODELS, ckpt_path)
    data_state = checkpoint.get(DATA_STATE_KEY)
    if saved_class not in (LanguageModel, None):
        raise ValueError(
            f"--ckpt_path {ckpt_path}: holds a {saved_class.__name__}, and generate samples text from a "
            "LanguageModel: pass the checkpoint of a language model run (`seqnorm predict` labels text with a "
            "classifier)"
        )
    if not isinstance(data_state, dict) or "unit" not in data_state:
        raise ValueError(
            f"--ckpt_path {ckpt_path}: not a LanguageModel checkpoint written by `seqnorm fit` (it holds no "
            "vocabulary); pass a checkpoint of a language model run"
        )
    shapes = weight_shapes(checkpoint, ckpt_path)
    try:  # strict=False: a tensor missing or one too many is check_weights_fit's to name, below
        model = LanguageModel._from_checked(checkpoint, ckpt_path, "--ckpt_path", map_location="cpu", strict=False)
    except RuntimeError as error:  # load_state_dict's size mismatch
        detail = " ".join(str(error).split())
        raise ValueError(
            f"--ckpt_path {ckpt_path}: its weights do not fit the LanguageModel its hyperparameters describe "
            f"({detail}): pass a checkpoint written by `seqnorm fit` as it was"
        ) from None
    check_weights_fit(shapes, model, ckpt_path)
    try:
        vocab = Vocabulary.from_dict(data_state["vocab"])
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"--ckpt_path {ckpt_path}: {error}") from None
    where = f"--ckpt_path {ckpt_path}"
    if len(vocab) != model.hparams.vocab_size:
        what = f"its vocabulary has {len(vocab)} tokens and its model {model.hparams.vocab_size}"
        raise corrupt_checkpoint(where, what)
    if data_state.get("level") not in ("char", "word") or data_state["unit"] not in UNITS:
        got = f"level={data_state.get('level')!r}, unit={data_state['unit']!r}"
        raise corrupt_checkpoint(where, f"expected its data level 'char' or 'word' and a unit of {UNITS}, got {got}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    window_length = data_state.get("window_length")  # None in checkpoints of before 2026-11-25: the index counts on
    restarts = data_state["unit"] == "stream" and model.hparams.stream_steps == "restart"
    window_steps = window_length - 1 if restarts and isinstance(window_length, int) and window_length > 1 else None
    with warnings.catch_warnings(record=True) as said:  # one line each, not Python's file:line and source line
        warnings.simplefilter("always")
        continuation = generate_text(
            model.model,
            vocab,
            level=data_state["level"],
            unit=data_state["unit"],
            prompt=prompt,
            length=length,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
            window_steps=window_steps,
        )
    for warning in said:
        print(f"seqnorm generate: warning: {warning.message}", file=sys.stderr)
    words_apart = data_state["level"] == "word" and prompt and not prompt[-1].isspace()
    return prompt + (" " if words_apart and continuation[:1] not in ("", "\n") else "") + continuation


def _generate_command(args: list[str]) -> None:
    # one token at a time at batch size 1: the smallest steps there are (no --threads flag: SEQNORM_THREADS)
    configure_threads(None, has_flag=False)
    text = auto_cli(generate, args=args, prog="seqnorm generate", parser_class=FunctionFlagParser)
    prompt = flag_value(args, "--prompt") or ""
    show_generated(text, len(prompt) if text.startswith(prompt) else 0)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``seqnorm`` console script."""
    argv = sys.argv[1:] if args is None else args
    if answer_without_lightning(argv):  # --version, --help, configs, usage errors (what seqnorm.cli.entry answers)
        return
    quiet_known_noise()
    command = argv[0]
    failed = True  # until the command returns: a run that failed before its first step leaves no folder behind
    try:
        argv = resolve_config_names(argv)  # `--config seqnorm:NAME`: a config shipped with the package
        check_config_files(argv)
        argv = with_checkpoint_model(argv, MODELS, DATAMODULES)  # `test --ckpt_path X` without --model, --data
        if args is None:
            sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and warns when given args beside it)
        else:
            args = argv
        if command == "generate":
            _generate_command(argv[1:])
        else:
            with disk_full_held_in_threads():  # TensorBoard writes in a thread: its full disk is one line too
                # args None: LightningCLI reads sys.argv itself; prog: also under `python -m seqnorm`, and in tests
                cli = SeqnormCLI(args=args, seed_everything_default=0, parser_kwargs={"prog": "seqnorm"})
            if cli.trainer.received_sigterm:  # the run finished before the loops noticed the signal
                raise SIGTERMException
        failed = False
    except SIGTERMException:  # Lightning's SystemExit(None) would exit 0, as if the run had completed
        failed = False  # stopped, not failed: its last.ckpt is what a requeued job resumes from
        print(f"seqnorm {command}: stopped by SIGTERM", file=sys.stderr)
        raise SystemExit(SIGTERM_EXIT_CODE) from None
    except (ValueError, MisconfigurationException) as error:
        # Our user-facing errors (DataError included) are ValueErrors with a full message; Lightning's
        # MisconfigurationException is its word for a contradicting Trainer setting (its message names both).
        if os.environ.get("SEQNORM_DEBUG"):
            raise
        shown = user_error(error) if isinstance(error, ValueError) else error
        print(f"seqnorm {command}: error: {in_command_line_words(str(shown), MODELS)}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("SEQNORM_DEBUG"):
            raise
        print(f"seqnorm {command}: error: {disk_full_message(error)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        release_unused_runs(failed)  # an empty version_N, or a failed one with no step taken, is removed


if __name__ == "__main__":
    main()
