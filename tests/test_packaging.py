"""What a ``pip install`` gets: every shipped config inside the wheel and reachable by name, ``seqnorm:NAME``; the
kernels' C++ sources in the wheel and the sdist, and, in a fresh virtual environment, the kernels built on first use."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from seqnorm.cli import main
from seqnorm.shipped_configs import config_dir, config_path, resolve_config_names, shipped_configs
from tests.kernels.test_kernel_build import COMPILE_STUB

ROOT = Path(__file__).resolve().parent.parent
# The compiler replaced by one that records its call (argv[1]) and hands out this machine's build (argv[2]).
FIRST_USE_STUB = COMPILE_STUB + "cpp_extension.load = compile_stub\n"
CONFIGS = ROOT / "configs"
NAMES = sorted(path.relative_to(CONFIGS).with_suffix("").as_posix() for path in CONFIGS.rglob("*.yaml"))


def test_every_config_is_reachable_by_name() -> None:
    assert config_dir() == CONFIGS  # a checkout: the repository's own directory
    assert list(shipped_configs()) == NAMES and "norm/batch" in NAMES
    for name in NAMES:
        path = CONFIGS / f"{name}.yaml"
        assert config_path(name) == path == config_path(f"seqnorm:{name}")
        argv = ["fit", "--config", f"seqnorm:{name}", f"--config=seqnorm:{name}", "-c", f"seqnorm:{name}"]
        assert resolve_config_names(argv) == ["fit", "--config", str(path), f"--config={path}", "-c", str(path)]
    untouched = ["fit", "--config", "configs/char_lm.yaml", "--data.path", "seqnorm:char_lm"]  # not a --config value
    assert resolve_config_names(untouched) == untouched
    with pytest.raises(ValueError, match=r"^--config: expected seqnorm:<name> with one of .*char_lm.*got 'x'"):
        config_path("x")


def test_the_command_line_takes_names_and_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", "seqnorm:embedded_lm", "--config=seqnorm:norm/batch", "--print_config"])
    assert stopped.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["norm"] == "batch" and printed["model"]["init_args"]["norm_max_steps"] == 256
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", "seqnorm:no_such_config"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "seqnorm fit: error: --config: expected seqnorm:<name> with one of the shipped configs" in error
    main(["configs"])
    listed = capsys.readouterr().out
    for name in NAMES:
        assert f"seqnorm:{name} " in listed and str(CONFIGS / f"{name}.yaml") in listed


def test_pyproject_lists_every_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(setuptools.find_packages(str(ROOT), include=["seqnorm*"]))
    folders = {path.parent.relative_to(CONFIGS).parts for path in CONFIGS.rglob("*.yaml")}
    data_packages = {".".join(("seqnorm", "configs", *parts)) for parts in folders} | {"seqnorm.csrc"}
    assert set(config["packages"]) == found | data_packages
    assert config["package-dir"] == {"seqnorm.configs": "configs"}


def _triton_range() -> tuple[Any, Any, Any]:
    """``[gpu]``'s triton specifier, the lowest version tested ([test]'s pin) and the highest (the Makefile's)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (declared,) = [Requirement(r).specifier for r in extras["gpu"] if Requirement(r).name == "triton"]
    (pinned,) = [Requirement(r).specifier for r in extras["test"] if Requirement(r).name == "triton"]
    makefile = (ROOT / "Makefile").read_text()
    highest = re.search(r"^TRITON_HIGHEST := (\S+)$", makefile, re.MULTILINE).group(1)  # type: ignore[union-attr]
    return declared, Version(str(next(iter(pinned))).removeprefix("==")), Version(highest)


def test_make_test_tests_both_ends_of_the_declared_triton_range() -> None:
    """``[gpu]`` allowed triton 3.6 to 3.9 while only 3.6 was tested, and 3.9's interpreter refused two kernels: the
    lowest version the range allows is [test]'s pin, the highest is the Makefile's second run, and nothing above it
    (a newer minor) is admitted untested."""
    from packaging.version import Version

    declared, lowest, highest = _triton_range()
    makefile = (ROOT / "Makefile").read_text()
    assert lowest in declared and highest in declared
    below = Version(f"{lowest.major}.{lowest.minor - 1}.99") if lowest.minor else Version(f"{lowest.major - 1}.99")
    assert below not in declared, "the range admits a version below the tested lowest"
    assert Version(f"{highest.major}.{highest.minor + 1}.0") not in declared, "the range admits an untested minor"
    assert (
        "PYTHONPATH=$(HIGHEST) $(BIN)/python -m pytest" in makefile
        and "tests/kernels/test_triton_backend.py" in makefile
    )


def test_the_docs_name_the_tested_triton_versions() -> None:
    """Where a user reads which triton ``[gpu]`` takes and what ``make test`` runs it under (README, docs/index.md,
    docs/performance.md), the versions are the tested ends: moving TRITON_HIGHEST or [test]'s pin moves the docs."""
    _, lowest, highest = _triton_range()
    span = f"{lowest.major}.{lowest.minor}-{highest.major}.{highest.minor}"

    def text(name: str) -> str:
        return " ".join((ROOT / name).read_text().split())

    for page in ("README.md", "docs/index.md"):
        assert f'pip install ".[gpu]" # + triton {span} ' in text(page), page
    assert f"triton {highest}, the highest" in text("README.md") and f".venv/triton-{highest}" in text("README.md")
    performance = text("docs/performance.md")
    assert f"allows triton {lowest.major}.{lowest.minor} to {highest.major}.{highest.minor}:" in performance
    assert f"{lowest} (the test extra's pin" in performance and f".venv/triton-{highest}" in performance
    # the table of which torch ships which triton ends at the tested ends
    (row,) = [line for line in (ROOT / "docs/performance.md").read_text().splitlines() if line.startswith("| triton |")]
    assert row.split("|")[2].strip() == str(lowest) and row.split("|")[-2].strip().endswith(f"({highest})"), row


def test_the_wheel_ships_every_config(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject.toml's build requirement (built here, offline)
        pytest.skip(f"building needs setuptools>=77, this environment has {setuptools.__version__}")
    source = tmp_path / "source"  # a copy: a build writes build/ and *.egg-info beside the sources
    for name in ("seqnorm", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*command, "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "wheel").glob("seqnorm-*.whl")
    kernel_sources = {f"seqnorm/csrc/{path.name}" for path in (ROOT / "seqnorm" / "csrc").iterdir()}  # built on use
    with zipfile.ZipFile(wheel) as archive:
        shipped = {f"seqnorm/configs/{name}.yaml" for name in NAMES} | {"seqnorm/py.typed"} | kernel_sources
        assert shipped <= set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    # The sdist (what `pip install seqnorm` builds from where no wheel fits) carries the kernels' sources as well.
    sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'sdist')!r}))"
    (tmp_path / "sdist").mkdir()
    made = subprocess.run([sys.executable, "-c", sdist], cwd=source, check=True, capture_output=True, text=True)
    with tarfile.open(tmp_path / "sdist" / made.stdout.split()[-1]) as archive:
        top = made.stdout.split()[-1].removesuffix(".tar.gz")
        assert {f"{top}/{name}" for name in kernel_sources} <= set(archive.getnames())
    # Installed (here: unpacked, as pip does), the package finds them inside itself, by the same names.
    probe = "import json; from seqnorm import shipped_configs as s; print(json.dumps(s.shipped_configs(), default=str))"
    environment = {**os.environ, "PYTHONPATH": str(tmp_path / "installed")}
    result = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=environment, cwd=tmp_path
    )
    found = json.loads(result.stdout)
    assert list(found) == NAMES
    inside = tmp_path / "installed" / "seqnorm" / "configs"
    assert all(Path(path).is_relative_to(inside) for path in found.values())


def test_a_fresh_install_builds_the_kernels_on_first_use(tmp_path: Path, built_library: Path) -> None:
    """Issue 31: after ``pip install .`` in a new environment the first layer warned "not built" and every step ran
    the plain path (1.0-1.2 s against 0.47-0.64 s). Now the first layer builds them, with one notice, into the
    cache, and runs them. The compiler itself is stubbed as in ``tests/kernels/test_kernel_build.py`` (it hands out this
    machine's build: a real compile takes 1.5-3 minutes on 2 cores); the same ``build()`` compiles for real in every
    fresh set-up, where ``make venv`` runs ``python -m seqnorm.kernels``.

    The environment is a new venv whose installed dependencies (torch, ninja, filelock, setuptools) are this
    one's, as after ``pip install torch``: a ``.pth`` file adds this environment's site-packages and ``ninja`` is
    linked beside its interpreter, where pip puts it. The package is installed from a copy of the sources with
    ``--no-deps --no-build-isolation`` (nothing is downloaded); the layer runs outside the checkout, with an empty
    kernel cache.
    """
    ninja = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    if shutil.which(os.environ.get("CXX", "c++")) is None or ninja is None:
        pytest.skip("no C++ compiler or ninja: the kernels cannot be built here")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building needs setuptools>=77, this environment has {setuptools.__version__}")
    source = tmp_path / "source"
    for name in ("seqnorm", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([python, "-c", where], check=True, capture_output=True, text=True).stdout.strip())
    ours = sorted({path for path in sys.path if path.endswith("site-packages")})
    (site / "dependencies.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    (venv / "bin" / "ninja").symlink_to(ninja)
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation"]
    subprocess.run([*install, "--no-index", "-q", str(source)], check=True, capture_output=True, timeout=300)

    work = tmp_path / "elsewhere"  # outside the checkout: the installed copy is the one imported
    work.mkdir()
    cache = tmp_path / "kernels"
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "SEQNORM_KERNELS")}
    environment |= {"SEQNORM_KERNELS_DIR": str(cache), "PYTHONWARNINGS": "always"}
    probe = FIRST_USE_STUB + (
        "import torch, seqnorm\n"
        "layer = seqnorm.LSTM(8, 16, norm='layer')\n"
        "x = torch.randn(6, 3, 8)\n"
        "print(layer.plan(x).path)\n"
        "layer(x)[0].sum().backward()\n"
        "print(seqnorm.__file__)\n"
        "print(seqnorm.kernels.status())\n"
    )
    record = tmp_path / "builds.txt"
    result = subprocess.run(
        [python, "-c", probe, str(record), str(built_library)], cwd=work, env=environment, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    path, module, status = result.stdout.splitlines()
    assert Path(module).is_relative_to(site), module  # the pip-installed copy, not the checkout
    assert path == "kernel", result.stderr
    library = Path(status.removeprefix("on (").removesuffix(")"))
    assert library.parent.parent == cache and library.exists(), status  # the build in place, as the next process finds
    assert result.stderr.count("seqnorm: building the C++ kernels") == 1, result.stderr
    assert record.read_text().splitlines() == ["built"]
    assert "RuntimeWarning" not in result.stderr, result.stderr
