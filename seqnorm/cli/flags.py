"""A mistyped flag of the ``seqnorm`` command: one short error naming it and the closest valid flags.

jsonargparse answers ``seqnorm fit --model.hiden_size 10`` with the whole usage (about 40 lines of ``--trainer.*``)
and a nested "Does not validate against any of the Union subtypes" report, and no "did you mean". The parser here
checks the command line's flags first: the first one that is no option of the parser, nor an argument of the class
chosen for ``--model``/``--data``/``--optimizer``/``--lr_scheduler`` (``--model.hidden_size``), is named with
:func:`difflib.get_close_matches` over the valid ones, in two lines. A model argument of before norm specs
(``max_steps``, a norm option inside ``rnn_options``), as a flag or in a ``--config`` file, is one line naming its
replacement (:func:`~seqnorm.lightning.old_hparams.old_key_error`). A value that is none of a model or data
argument's choices (``--model.cell lstmm``) is one sentence with the choices and the nearest one, and a value that is
not the integer or finite number such an argument takes (``--model.hidden_size 8.5``) one sentence saying so
(:func:`bad_value`). A ``--model.<arg>``/``--data.<arg>`` flag without its class is one line asking for the class
(:func:`class_not_named`). A value not of its flag's type anywhere else (``--trainer.max_steps 2.5``, ``--threads
-2``, ``generate --length 3.5``, or the same in a ``--config`` file) is one sentence saying what the flag takes
(:func:`typed_value_error`). Any other error (a value for a class or a path, a typo inside a ``--config`` file)
keeps jsonargparse's full report.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import math
import operator
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NoReturn

import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

from seqnorm.lightning.old_hparams import old_key_error
from seqnorm.shipped_configs import config_values

__all__ = [
    "FlagSuggestingParser",
    "FunctionFlagParser",
    "bad_value",
    "class_flags",
    "class_not_named",
    "typed_value_error",
    "unknown_flag",
]

_NESTED_BASES = {"optimizer": torch.optim.Optimizer, "lr_scheduler": torch.optim.lr_scheduler.LRScheduler}
_NESTED_MODULES = {"optimizer": torch.optim, "lr_scheduler": torch.optim.lr_scheduler}


def _flag(token: str) -> str | None:
    """The flag a command-line word sets (``--a.b=1`` and ``--a.b+=X`` set ``--a.b``), ``None`` for a value."""
    if not token.startswith("--") or token == "--":
        return None
    return token.partition("=")[0].removesuffix("+")


def class_flags(cls: type, key: str) -> list[str]:
    """The flags that set ``cls``'s arguments under ``--key`` (``--model.hidden_size``), as jsonargparse makes them."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True)
    return sorted(flag for action in parser._actions for flag in action.option_strings if flag.startswith(f"--{key}."))


def _named_class(name: str, candidates: Iterable[type]) -> type | None:
    for cls in candidates:
        if name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}") or name.endswith(f".{cls.__qualname__}"):
            return cls
    module, _, attribute = name.rpartition(".")
    try:  # a class path of the user's own (jsonargparse imports it the same way)
        found = getattr(importlib.import_module(module), attribute) if module else None
    except (ImportError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _candidates(key: str, nested: dict[str, Sequence[type]]) -> list[type]:
    if key in nested:
        return list(nested[key])
    if key in _NESTED_BASES:
        base = _NESTED_BASES[key]
        return [cls for cls in vars(_NESTED_MODULES[key]).values() if isinstance(cls, type) and issubclass(cls, base)]
    return []


def _accepted(flag: str, options: Sequence[str]) -> bool:
    """Whether ``flag`` is one of ``options``, or a key under an option whose keys are not listed there
    (``--trainer.callbacks.step``, ``--model.norm.init_args.eps``). Not a prefix of one: the parsers take no
    abbreviations (``--trainer.max_step`` ran as ``--trainer.max_steps``, unsaid)."""
    if flag in options:
        return True
    parent = flag.rpartition(".")[0]
    if parent and any(option.startswith(f"{parent}.") for option in options):
        return False  # its siblings are listed: it is not
    return any(flag.startswith(f"{option}.") for option in options)


def _closest(flag: str, valid: Sequence[str]) -> list[str]:
    """Up to three of ``valid`` like ``flag``: by the last name among its siblings, else by the last name or the
    whole flag anywhere (``--hidden_size`` -> ``--model.hidden_size``)."""
    parent, _, leaf = flag.rpartition(".")
    siblings = {option.rpartition(".")[2]: option for option in valid if option.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.7)
    if close:
        return [siblings[name] for name in close]
    leaves = {option.rpartition(".")[2].removeprefix("--"): option for option in valid}
    close = [leaves[name] for name in difflib.get_close_matches(leaf.removeprefix("--"), list(leaves), n=3, cutoff=0.8)]
    return close or difflib.get_close_matches(flag, valid, n=3, cutoff=0.8)


def unknown_flag(
    words: Sequence[str], options: Iterable[str], nested: dict[str, Sequence[type]]
) -> tuple[str, list[str], list[str]] | None:
    """The first flag of ``words`` that nothing accepts: ``(flag, closest valid flags, the names of the classes it
    was checked against)``; ``None`` when every flag is valid, or cannot be judged here (a class that does not
    import).

    ``options``: the parser's own option strings (:func:`_accepted` says which flags they take). ``nested``: the
    classes ``--model``/``--data`` may name; their arguments, and those of torch's optimizers and schedulers, are
    checked against the class the words choose (``--model LanguageModel``), or all of them when the words choose
    none (a ``--config`` may).
    """
    options = sorted(option for option in set(options) if not option.endswith(".help"))
    chosen: dict[str, str] = {}

    def classes_of(root: str) -> list[type]:
        classes = _candidates(root, nested)
        if not chosen.get(root):
            return classes
        named = _named_class(chosen[root], classes)
        return [named] if named is not None else []

    def flags_of(root: str, classes: list[type]) -> list[str]:
        return sorted({flag for cls in classes for flag in class_flags(cls, root) if not flag.endswith(".help")})

    for index, word in enumerate(words):
        flag = _flag(word)
        if flag is None:
            continue
        key = flag[2:]
        if key in _NESTED_BASES or key in nested:  # --model NAME: the class its flags belong to
            value = word.partition("=")[2] if "=" in word else (words[index + 1] if index + 1 < len(words) else "")
            chosen[key] = value
            continue
        root, _, rest = key.partition(".")
        if rest and (root in _NESTED_BASES or root in nested):
            classes = classes_of(root)
            rest = rest.removeprefix("init_args.")
            if not classes or rest in ("help", "class_path", "init_args", "dict_kwargs"):
                continue
            valid = flags_of(root, classes)
            if _accepted(f"--{root}.{rest}", valid):
                continue
            return flag, _closest(f"--{root}.{rest}", valid), [cls.__name__ for cls in classes]
        if _accepted(flag, options):
            continue
        pool = [option for option in options if option.startswith("--")]
        for root in nested:  # `--hidden_size` for `--model.hidden_size`
            pool += flags_of(root, classes_of(root))
        return flag, _closest(flag, pool), []
    return None


def _members(cls: type, name: str) -> tuple[Any, ...] | None:
    """The types ``cls``'s argument ``name`` may take, ``None`` dropped (an optional one), or ``None`` where its
    annotation does not resolve (no judgement here, jsonargparse's then)."""
    try:
        hint = typing.get_type_hints(cls.__init__).get(name)
    except Exception:
        return None
    if hint is None:
        return None
    return tuple(member for member in _union_members(hint) if member is not type(None))


def _union_members(hint: Any) -> tuple[Any, ...]:
    """The types of a union hint (``int | None``: ``int`` and ``NoneType``), or the hint alone."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _choices(cls: type, name: str) -> tuple[str, ...] | None:
    """The values ``cls``'s argument ``name`` takes when its type is a choice of strings (``Literal``, optional or
    not); ``None`` for any other type (a free string, a number, a spec)."""
    members = _members(cls, name)
    choices: list[str] = []
    for member in members or ():
        if typing.get_origin(member) is not typing.Literal or not all(isinstance(a, str) for a in member.__args__):
            return None
        choices += member.__args__
    return tuple(choices) or None


def _numbers(value: str) -> list[int | float]:
    """The numbers ``value`` reads as: by Python's ``int`` and ``float`` (``1e-3``, which YAML 1.1 reads as a string)
    and as YAML (``0x10``), as jsonargparse may read it."""
    read: list[int | float] = []
    for convert in (int, float):
        with contextlib.suppress(ValueError):
            read.append(convert(value))
    try:
        loaded = yaml.safe_load(value)
    except yaml.YAMLError:
        loaded = None
    if isinstance(loaded, int | float) and not isinstance(loaded, bool):
        read.append(loaded)
    return read


def _number_error(cls: type, name: str, value: str) -> str | None:
    """What is wrong with ``value`` for ``cls``'s argument ``name`` when its type is a number (``int`` or ``float``,
    optional or not): it reads as no integer, or as no finite number. ``None`` when the value fits, or the type is
    another."""
    members = _members(cls, name)
    if members == (int,):
        return None if any(isinstance(number, int) for number in _numbers(value)) else "expected an integer"
    if members == (float,):
        return None if any(math.isfinite(number) for number in _numbers(value)) else "expected a finite number"
    return None


def bad_value(words: Sequence[str], nested: dict[str, Sequence[type]]) -> str | None:
    """The error for the first ``--model.<arg>``/``--data.<arg>`` value that is none of the argument's choices
    (``--model.cell lstmm``, ``--data.unit lines``: the flag, the value, the choices and the nearest one, in one
    sentence; jsonargparse's report of the same ran to 60 lines and ended in ``NestedArg(key='cell', ...)``), or not
    the integer or finite number the argument takes (``--model.hidden_size 8.5``, ``--model.lr nan``: jsonargparse's
    report said of ``nan`` "Expected a <class 'float'>"). Judged against the class the words choose (``--model
    LanguageModel``), else every class that takes the argument; ``None`` when no value is judged wrong here."""
    chosen: dict[str, str] = {}
    for index, word in enumerate(words):
        flag = _flag(word)
        if flag is None:
            continue
        value = word.partition("=")[2] if "=" in word else (words[index + 1] if index + 1 < len(words) else None)
        root, _, name = flag[2:].partition(".")
        if root in nested and not name:
            chosen[root] = value or ""
            continue
        name = name.removeprefix("init_args.")
        if root not in nested or value is None or value.startswith("--") or value == "null" or "." in name:
            continue
        classes = list(nested[root])
        if chosen.get(root):
            named = _named_class(chosen[root], classes)
            classes = [named] if named is not None else []
        numbers = [error for cls in classes if (error := _number_error(cls, name, value)) is not None]
        if numbers and len(numbers) == sum(_members(cls, name) is not None for cls in classes):
            return f"{flag} {value}: {numbers[0]}, got {value!r}"
        found = [choices for cls in classes if (choices := _choices(cls, name)) is not None]
        if not found or any(value in choices for choices in found):
            continue
        choices = found[0]
        nearest = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        guess = f"; did you mean {nearest[0]}?" if nearest else ""
        return f"{flag} {value}: expected one of {', '.join(choices)}, got {value!r}{guess}"
    return None


_COMPARISONS = {operator.ge: ">=", operator.gt: ">", operator.le: "<=", operator.lt: "<"}
_KINDS = {bool: "true, false", int: "an integer", float: "a finite number", type(None): "null"}


def _expected(hint: Any) -> tuple[str, list[str]] | None:
    """What a flag of type ``hint`` takes, in words (``"an integer >= 0 or null"``), and its choices where it has
    some (a ``Literal``); ``None`` for a type described no simpler than jsonargparse does (a class, a path, a list)."""
    members = _union_members(hint)
    kinds: list[str] = []
    choices: list[str] = []
    for member in members:
        if typing.get_origin(member) is typing.Literal:
            choices += [str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in member.__args__]
        elif member in _KINDS:
            kinds += _KINDS[member].split(", ")
        elif isinstance(member, type) and issubclass(member, int | float) and hasattr(member, "_restrictions"):
            base = _KINDS[int if issubclass(member, int) else float]  # jsonargparse's NonNegativeInt and such
            bounds = [f"{_COMPARISONS[test]} {bound}" for test, bound in member._restrictions if test in _COMPARISONS]
            if len(bounds) != len(member._restrictions):
                return None
            kinds.append(f"{base} {' and '.join(bounds)}")
        else:
            return None
    choices = list(dict.fromkeys(choices))
    if "an integer" in kinds and "a finite number" in kinds:  # Lightning's int | float
        kinds.remove("an integer")
    if choices:
        kinds.insert(0, f"one of {', '.join(choices)}")
    if not kinds:
        return None
    return (kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"), choices


def typed_value_error(message: str, words: Sequence[str], actions: Iterable[Mapping[str, Any]]) -> str | None:
    """The error for a value that is not of its flag's type (``--trainer.max_steps 2.5``, ``--threads -2``,
    ``generate --length 3.5``): the flag, what it takes and the value, in one sentence, where jsonargparse's report
    (``message``, beginning ``Parser key "trainer.max_steps":``) ran to ten lines after the whole usage. ``actions``:
    the parsers' flags, each its option strings to actions. ``None`` for another error, or a flag whose type is no
    simpler to say than jsonargparse says it (a class, a path)."""
    found = re.match(r'Parser key "([^"]+)":', message)
    if found is None:
        return None
    flag = f"--{found.group(1)}"
    action = next((options[flag] for options in actions if flag in options), None)
    expected = _expected(getattr(action, "_typehint", None)) if action is not None else None
    if expected is None:
        return None
    takes, choices = expected
    value: str | None = None
    for index, word in enumerate(words):
        if _flag(word) == flag:
            value = word.partition("=")[2] if "=" in word else (words[index + 1] if index + 1 < len(words) else None)
    if value is None:  # set in a --config file: jsonargparse's report quotes it
        given = re.findall(r"(?:Given|Got) value: (.*)", message)
        value = given[-1].strip() if given else None
    if value is None:
        return f"{flag}: expected {takes}"
    nearest = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    guess = f"; did you mean {nearest[0]}?" if nearest else ""
    return f"{flag} {value}: expected {takes}, got {value!r}{guess}"


def class_not_named(words: Sequence[str], nested: dict[str, Sequence[type]]) -> str | None:
    """The error for a ``--model.<arg>``/``--data.<arg>`` flag given without its class (``--data TextCorpus``), on
    the command line or in a ``--config`` file: jsonargparse's report of it was the whole usage and
    ``NestedArg(key='path', ...)``. ``None`` where each such flag's class is named, or a config cannot be read here."""
    named = {word.partition("=")[0][2:] for word in words if word.partition("=")[0][2:] in nested}
    for _, _, value, _ in config_values(words):
        try:
            named |= set(_config_file(value)) & set(nested)
        except (OSError, ValueError, yaml.YAMLError):  # YAML text in place of a path, say: no judgement here
            return None
    for word in words:
        flag = _flag(word)
        root = None if flag is None else flag[2:].partition(".")[0]
        if root in nested and root not in named and "." in flag:
            names = _either([f"--{root} {cls.__name__}" for cls in nested[root]])
            return f"{flag}: no --{root} class given: name it before its flags, {names}"
    return None


def _either(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} or {flags[-1]}"


class _SuggestsFlags(ArgumentParser):
    """A jsonargparse parser whose error for a mistyped flag is two lines: the flag, the closest valid ones, and
    where the full list is (module docstring). ``nested_classes``: the classes ``--model``/``--data`` may name."""

    nested_classes: ClassVar[dict[str, Sequence[type]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # subcommands' parsers inherit it (jsonargparse)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        words = getattr(self, "args", None)  # what parse_args was given (jsonargparse keeps it)
        if self.exit_on_error and isinstance(words, list):
            try:
                old = old_model_key(words)
            except Exception:  # an unreadable config: jsonargparse's report says why
                old = None
            if old is not None:
                command = self.prog.replace(" [options]", "")
                print(f"{command}: error: {old}", file=sys.stderr)
                raise SystemExit(2)
            try:
                choice = bad_value(words, self.nested_classes)
            except Exception:  # a hint must never hide the error it explains
                choice = None
            if choice is not None:
                print(f"{self._command(words)}: error: {choice}", file=sys.stderr)
                raise SystemExit(2)
            try:
                found = self._unknown_flag(words)
            except Exception:  # a hint must never hide the error it explains: jsonargparse's report then
                found = None
            if found is None:
                try:
                    unnamed = class_not_named(words, self.nested_classes)
                except Exception:
                    unnamed = None
                if unnamed is not None:
                    print(f"{self._command(words)}: error: {unnamed}", file=sys.stderr)
                    raise SystemExit(2)
            if found is None:
                try:
                    typed = typed_value_error(message, words, self._flag_actions(words))
                except Exception:
                    typed = None
                if typed is not None:
                    print(f"{self._command(words)}: error: {typed}", file=sys.stderr)
                    raise SystemExit(2)
            if found is not None:
                command, (flag, close, owners) = found
                where = f"not a flag of {_either(owners)}" if owners else "no such flag"
                guess = f"; did you mean {_either(close)}?" if close else ""
                root = flag[2:].partition(".")[0]
                listing = f"{command} --{root}.help {owners[0]}" if len(owners) == 1 else f"{command} --help"
                print(f"{command}: error: {flag}: {where}{guess}\n({listing} lists the flags)", file=sys.stderr)
                raise SystemExit(2)
        super().error(message, ex)

    def _command(self, words: list[str]) -> str:
        """The command as jsonargparse's own tip names it ("seqnorm fit"), from this parser or its subcommand's."""
        command = self.prog.replace(" [options]", "")
        subcommands = self._subcommands_action
        subcommand = next((word for word in words if subcommands is not None and word in subcommands.choices), None)
        return f"{command} {subcommand}" if subcommand is not None else command

    def _flag_actions(self, words: list[str]) -> list[Mapping[str, Any]]:
        """This parser's flags, and those of the subcommand the words choose (``fit``'s ``--trainer.max_steps``)."""
        choices = self._subcommands_action.choices if self._subcommands_action is not None else {}
        chosen = [choices[word] for word in words if word in choices]
        return [self._option_string_actions, *(parser._option_string_actions for parser in chosen[:1])]

    def _unknown_flag(self, words: list[str]) -> tuple[str, tuple[str, list[str], list[str]]] | None:
        subcommands = self._subcommands_action
        parsers: dict[str, Any] = dict(subcommands.choices) if subcommands is not None else {}
        command = self.prog.replace(" [options]", "")  # as jsonargparse's own tip names it: "seqnorm fit"
        split = next((index for index, word in enumerate(words) if word in parsers), len(words))
        own = unknown_flag(words[:split], self._option_string_actions, self.nested_classes)
        if own is not None or split == len(words):
            return (command, own) if own is not None else None
        subcommand = words[split]
        found = unknown_flag(words[split + 1 :], parsers[subcommand]._option_string_actions, self.nested_classes)
        return (f"{command} {subcommand}", found) if found is not None else None


def old_model_key(words: list[str]) -> str | None:
    """The error for the first model argument of before norm specs in the command line's flags or ``--config``
    files, ``None`` if there is none."""
    for index, word in enumerate(words):
        flag, _, inline = word.partition("=")
        value = inline if inline else words[index + 1] if index + 1 < len(words) else ""
        if flag.startswith("--model."):
            key = flag.removeprefix("--model.").removeprefix("init_args.")
            if key == "rnn_options":
                keys = [f"rnn_options.{name}" for name in _mapping(json.loads(value))]
            else:
                keys = [key]
            for key in keys:
                error = old_key_error(flag, key)
                if error is not None:
                    return str(error)
        elif flag == "--config" and value:
            model = _mapping(_config_file(value).get("model"))
            nested = "init_args" in model  # `model: {class_path: ..., init_args: {...}}`, or the arguments themselves
            args = _mapping(model.get("init_args")) if nested else model
            keys = [*args, *(f"rnn_options.{name}" for name in _mapping(args.get("rnn_options")))]
            for key in keys:
                error = old_key_error(f"--config {value}: model.{'init_args.' if nested else ''}{key}", key)
                if error is not None:
                    return str(error)
    return None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _config_file(path: str) -> Mapping[str, Any]:
    """A ``--config`` file's top-level mapping, as ``yaml.safe_load`` reads it (empty for anything else)."""
    with open(path, encoding="utf-8") as file:
        return _mapping(yaml.safe_load(file))


class FlagSuggestingParser(_SuggestsFlags, LightningArgumentParser):
    """LightningCLI's parser (``SeqnormCLI``'s ``parser_class``) with the short error for a mistyped flag."""


class FunctionFlagParser(_SuggestsFlags):
    """jsonargparse's parser (``seqnorm generate``'s, through ``auto_cli``) with the short error for a mistyped flag."""
