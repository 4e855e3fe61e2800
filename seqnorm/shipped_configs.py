"""The YAML configs shipped with seqnorm, reachable by name: ``seqnorm fit --config seqnorm:char_lm``.

The repository keeps them in its top-level ``configs/`` (where the README's ``--config configs/...`` commands and the
tests read them); a wheel ships the same files as ``seqnorm/configs`` (``pyproject.toml`` maps one onto the other), so
an installed package reaches them without a checkout. A config's name is its path under that directory without
``.yaml``: ``char_lm``, ``embedded_lm``, ``norm/batch`` (the norm overlays), ...

``seqnorm configs`` lists them with their paths; :func:`resolve_config_names` turns every ``--config seqnorm:NAME``
(or ``--config=seqnorm:NAME``, ``-c seqnorm:NAME``) of a command line into that file's path before LightningCLI
parses it, and answers a ``--config configs/char_lm.yaml`` that does not exist (the README's commands, run outside a
checkout) with the shipped config of that name: ``--config seqnorm:char_lm``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "CONFIG_PREFIX",
    "config_dir",
    "config_path",
    "config_values",
    "describe_configs",
    "resolve_config_names",
    "shipped_configs",
    "shipped_name_of",
]

CONFIG_PREFIX = "seqnorm:"
"""What marks a ``--config`` value as the name of a shipped config rather than a path."""

_CONFIG_FLAGS = ("--config", "-c")


def config_dir() -> Path:
    """Where the shipped configs are: ``seqnorm/configs`` in an installed wheel, ``configs/`` in a checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "configs", package.parent / "configs"):
        if candidate.is_dir():
            return candidate
    raise ValueError(
        f"seqnorm: expected the shipped configs in {package / 'configs'} (a wheel) or {package.parent / 'configs'} "
        "(a checkout), got neither: reinstall seqnorm"
    )


def shipped_configs() -> dict[str, Path]:
    """Every shipped config by name (its path under :func:`config_dir` without ``.yaml``), sorted by name."""
    root = config_dir()
    return {path.relative_to(root).with_suffix("").as_posix(): path for path in sorted(root.rglob("*.yaml"))}


def config_path(name: str) -> Path:
    """The file of the shipped config ``name`` (with or without the ``seqnorm:`` prefix); a ``ValueError`` listing
    the names otherwise."""
    configs = shipped_configs()
    key = name.removeprefix(CONFIG_PREFIX)
    if key not in configs:
        raise ValueError(
            f"--config: expected {CONFIG_PREFIX}<name> with one of the shipped configs ({', '.join(configs)}; "
            f"`seqnorm configs` lists them with their paths), got {name!r}"
        )
    return configs[key]


def shipped_name_of(path: str) -> str | None:
    """The shipped config a missing ``--config`` file names, if any: ``configs/norm/batch.yaml`` -> ``norm/batch``,
    ``char_lm.yaml`` -> ``char_lm`` (a file name alone also finds ``norm/NAME`` when only one config has it)."""
    file = Path(path)
    if file.suffix not in (".yaml", ".yml") or "://" in path or file.exists():
        return None
    configs = shipped_configs()
    nested = Path(file.parent.name, file.stem).as_posix()
    if nested in configs:
        return nested
    same_stem = [name for name in configs if name.rpartition("/")[2] == file.stem]
    return same_stem[0] if len(same_stem) == 1 else None


def config_values(argv: Sequence[str]) -> Iterator[tuple[int, str, str, str]]:
    """``(index, flag, value, written)`` for every ``--config``/``-c`` value of a command line: ``argv[index]`` is
    ``written + value`` (``written``: ``"--config="`` for the one-word form, else empty)."""
    for index, argument in enumerate(argv):
        flag, equals, value = argument.partition("=")
        if equals and flag in _CONFIG_FLAGS:
            yield index, flag, value, f"{flag}="
        elif index and argv[index - 1] in _CONFIG_FLAGS:
            yield index, argv[index - 1], argument, ""


def resolve_config_names(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``seqnorm:NAME`` value of ``--config``/``-c`` replaced by that config's path; a
    ``ValueError`` suggesting ``--config seqnorm:NAME`` for a config file that does not exist but is shipped."""
    resolved = list(argv)
    for index, flag, value, written in config_values(argv):
        if value.startswith(CONFIG_PREFIX):
            resolved[index] = f"{written}{config_path(value)}"
        elif (name := shipped_name_of(value)) is not None:  # else jsonargparse's "File does not exist" names it
            raise ValueError(
                f"{flag} {value}: no such file (the repository's configs/ is not in this directory); seqnorm ships "
                f"a config of that name: pass {flag} {CONFIG_PREFIX}{name} (`seqnorm configs` lists them)"
            )
    return resolved


def describe_configs() -> str:
    """What ``seqnorm configs`` prints: each shipped config's name and path, and how to use them."""
    configs = shipped_configs()
    width = max(len(name) for name in configs)
    lines = [f"{CONFIG_PREFIX}{name:<{width}}  {path}" for name, path in configs.items()]
    usage = (
        f"\nUse: seqnorm fit --config {CONFIG_PREFIX}char_lm --config {CONFIG_PREFIX}norm/batch --data.path my.txt "
        "(task configs first, then a norm overlay; later flags override them)"
    )
    return "\n".join(lines) + usage
