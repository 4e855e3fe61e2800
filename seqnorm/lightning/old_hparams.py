"""Hyperparameters saved before norm specs, read under today's names: the one place old keys are translated.

Checkpoints (``hyper_parameters``) and ``hparams.yaml`` files written by earlier versions of the task modules may hold

- ``max_steps``: the old name of ``norm_max_steps`` (it read like the Trainer's ``--trainer.max_steps``);
- norm options inside ``rnn_options`` (``eps``, ``momentum``, ``affine``, ``gamma_init``, ``beta_init``,
  ``input_stats``, ``beyond_max_steps``, the placement switches ``norm_placement`` and ``state_norm``, and
  ``norm_options``): today fields of the spec passed as ``norm``;
- ``small_batch: error`` with a norm that has no batch statistics (the model-wide default before ``"tail"``).

:func:`current_hparams` folds them into what today's :class:`~seqnorm.lightning.LanguageModel` and
:class:`~seqnorm.lightning.SequenceClassifier` take, so such a checkpoint builds the same model. The command line does
not translate: an old key in a flag or a ``--config`` file is refused with :func:`old_key_error`, which names the
replacement (a config is text its owner can edit; a checkpoint is not).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from seqnorm.norms import DEFAULT_SMALL_BATCH, NORMS, REMOVED_OPTIONS
from seqnorm.norms.specs import default_of, field_names

__all__ = ["OLD_NORM_OPTIONS", "RENAMED_HPARAMS", "current_hparams", "old_key_error"]

RENAMED_HPARAMS = {"max_steps": "norm_max_steps"}
"""Old name -> new name of the task modules' arguments."""

OLD_NORM_OPTIONS: dict[str, Any] = REMOVED_OPTIONS
"""Norm options that ``rnn_options`` took before specs, each with its default of then: the norms' own list of what
they no longer take as keywords (:data:`seqnorm.norms.REMOVED_OPTIONS`)."""


def current_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` with the keys of before (see the module) translated; what is already current is kept as is."""
    current = dict(hparams)
    for old, new in RENAMED_HPARAMS.items():
        if old in current:
            value = current.pop(old)
            if value is not None:
                current.setdefault(new, value)  # a new name already saved wins
    options = current.get("rnn_options")
    if isinstance(options, Mapping) and ({"norm_options", *OLD_NORM_OPTIONS} & options.keys()):
        options = dict(options)
        moved = {key: options.pop(key) for key in OLD_NORM_OPTIONS if key in options}
        moved.update(options.pop("norm_options", None) or {})
        current["rnn_options"] = options or None
        current["norm"] = _with_options(current.get("norm"), moved)
    norm = current.get("norm")
    name = norm if isinstance(norm, str) else norm.get("name") if isinstance(norm, Mapping) else None
    if current.get("small_batch") == "error" and name in NORMS and "small_batch" not in field_names(NORMS[name].spec):
        current["small_batch"] = DEFAULT_SMALL_BATCH  # saved whatever the norm when "error" was the default
    return current


def _with_options(norm: Any, options: Mapping[str, Any]) -> Any:
    """``norm`` (a registry name or a spec's ``to_dict()``) with ``options`` folded in: still a name when they are all
    its defaults, else a spec's plain data. Anything else is returned as it is, for the model to refuse."""
    data = {"name": norm} if isinstance(norm, str) else dict(norm) if isinstance(norm, Mapping) else None
    if data is None or data.get("name") not in NORMS:
        return norm
    spec = NORMS[data["name"]].spec
    fields = field_names(spec)
    for key, value in options.items():
        if key not in fields and key in OLD_NORM_OPTIONS and _same(value, OLD_NORM_OPTIONS[key]):
            continue  # a default of then, which the norm ignored
        data[key] = value  # a key the norm does not have stays, so that the model names it
    if isinstance(norm, str) and all(
        k in fields and _same(v, default_of(spec, k)) for k, v in data.items() if k != "name"
    ):
        return norm
    return data


def _same(value: Any, default: Any) -> bool:
    return value == default and isinstance(value, bool) == isinstance(default, bool)  # 1 == True


def old_key_error(where: str, key: str) -> ValueError | None:
    """The one-line error for an old ``key`` of the model's arguments (``max_steps``, or ``rnn_options.<option>``)
    found in ``where`` (a flag or a config file), naming its replacement; ``None`` for a key that is not an old one."""
    if key in RENAMED_HPARAMS:
        new = RENAMED_HPARAMS[key]
        return ValueError(
            f"{where}: model argument {key!r} was renamed {new!r} (the time steps with their own batch-norm "
            f"statistics; the length of training is --trainer.max_steps): write --model.{new}"
        )
    option = key.removeprefix("rnn_options.")
    if option != key and (option in OLD_NORM_OPTIONS or option == "norm_options"):
        field = "<option>" if option == "norm_options" else option
        return ValueError(
            f"{where}: rnn_options.{option} is no longer accepted: a norm's options are fields of its spec, write "
            f"--model.norm.class_path seqnorm.norms.<Norm>Spec --model.norm.init_args.{field} ... (model: norm: "
            f"{{class_path: ..., init_args: {{{field}: ...}}}} in a config)"
        )
    return None
