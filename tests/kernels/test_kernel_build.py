"""The compiled kernels built where a user first needs them (issue 31: after ``pip install`` the layers ran the plain
path until someone ran ``python -m seqnorm.kernels``): the first layer builds them with one notice, processes that
start together build once (a file lock) and the others wait and load, later processes load the cached build,
``SEQNORM_KERNELS=0`` builds nothing, and a failed build is recorded and not retried by every process after it.

The compile itself is stubbed: it records its call and puts this machine's real build where torch would have written
it, so the processes load and run the real kernels (``tests/test_packaging.py`` does the same in a fresh virtual
environment with the package installed by pip). The real compile runs through the same ``build()`` in every fresh
set-up (``make venv``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

import seqnorm
from seqnorm import kernels
from seqnorm.kernels import cpu

NOTICE = "seqnorm: building the C++ kernels"
WAITING = "seqnorm: waiting for another process to finish building"

# A process as a user's: its first normalized layer asks for the kernels. The compile is replaced by one that records
# the call (one line per build, in argv[1]) and copies the real library (argv[2]) into torch's build directory.
COMPILE_STUB = """
import shutil, sys
from pathlib import Path
from torch.utils import cpp_extension

def compile_stub(name, sources, build_directory, **kwargs):
    with open(sys.argv[1], "a") as record:
        record.write("built\\n")
    shutil.copy(sys.argv[2], Path(build_directory) / "seqnorm_kernels.so")
"""
FIRST_LAYER = (
    COMPILE_STUB
    + """
import torch
import seqnorm

cpp_extension.load = compile_stub
layer = seqnorm.LSTM(3, 4, norm="layer")
x = torch.randn(5, 2, 3)
path = layer.plan(x).path
layer(x)[0].sum().backward()
print(path)
"""
)


def _environment(cache: Path, **overrides: str) -> dict[str, str]:
    # CXX: any program that exists, so that the build is attempted on a machine without a compiler too (the stub
    # never runs it); warnings shown, so that a fallback's RuntimeWarning is seen.
    return {
        **os.environ,
        "SEQNORM_KERNELS_DIR": str(cache),
        "CXX": sys.executable,
        "PYTHONWARNINGS": "always",
        **overrides,
    }


def _first_layer(cache: Path, library: Path, record: Path, **overrides: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", FIRST_LAYER, str(record), str(library)]
    return subprocess.run(command, env=_environment(cache, **overrides), capture_output=True, text=True, timeout=300)


def _builds(record: Path) -> int:
    return len(record.read_text().splitlines()) if record.exists() else 0


def test_the_first_layer_builds_the_kernels_once_with_one_notice(tmp_path: Path, built_library: Path) -> None:
    """The user's case: an empty cache (a fresh install), the first layer call. It ran the plain path with "not
    built" before; now it builds them, says so once (where, how long, how to opt out), and runs them. The next
    process loads the cached build: no build, no notice."""
    cache, record = tmp_path / "cache", tmp_path / "builds.txt"
    first = _first_layer(cache, built_library, record)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["kernel"], first.stderr
    assert _builds(record) == 1
    notices = [line for line in first.stderr.splitlines() if line.startswith(NOTICE)]
    assert len(notices) == 1, first.stderr
    assert str(cache) in notices[0] and kernels.BUILD_TIME in notices[0] and "SEQNORM_KERNELS=0" in notices[0]
    assert "seqnorm: the C++ kernels are built (" in first.stderr
    assert "RuntimeWarning" not in first.stderr
    again = _first_layer(cache, built_library, record)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["kernel"] and _builds(record) == 1
    assert "seqnorm:" not in again.stderr and "RuntimeWarning" not in again.stderr


def test_processes_starting_together_build_once(tmp_path: Path, built_library: Path) -> None:
    """Two processes (DDP ranks, pytest-xdist workers, two terminals) reach their first layer while the cache is
    empty and a build is under way (this test holds the build's lock until both say they wait): one builds, the
    other waits, then loads that build; both run the kernels."""
    cache, record = tmp_path / "cache", tmp_path / "builds.txt"
    key = kernels._build_key(cpu.capability())
    cache.mkdir()
    lock = FileLock(cache / f"{key}.lock")
    command = [sys.executable, "-c", FIRST_LAYER, str(record), str(built_library)]
    logs = [tmp_path / f"stderr-{rank}.txt" for rank in range(2)]
    with lock:
        processes = []
        for log in logs:
            with log.open("w") as stderr:
                processes.append(
                    subprocess.Popen(command, env=_environment(cache), stdout=subprocess.PIPE, stderr=stderr, text=True)
                )
        deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
        while not all(WAITING in log.read_text() for log in logs):
            if any(process.poll() is not None for process in processes) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    errors = [log.read_text() for log in logs]
    assert [process.returncode for process in processes] == [0, 0], errors
    assert all(WAITING in error for error in errors), errors
    assert [output.split() for output in outputs] == [["kernel"], ["kernel"]], errors
    assert _builds(record) == 1
    assert sum(error.count(NOTICE) for error in errors) == 1, errors


def test_switched_off_nothing_is_built(tmp_path: Path, built_library: Path) -> None:
    cache, record = tmp_path / "cache", tmp_path / "builds.txt"
    result = _first_layer(cache, built_library, record, SEQNORM_KERNELS="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["loop"]
    assert _builds(record) == 0 and not cache.exists()
    assert "seqnorm:" not in result.stderr and "RuntimeWarning" not in result.stderr


def _failing_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    from torch.utils import cpp_extension

    calls: list[str] = []

    def compile_stub(*args: Any, **kwargs: Any) -> None:
        calls.append("built")
        raise RuntimeError("Error building extension 'seqnorm_kernels': fatal error: Python.h: No such file")

    monkeypatch.setattr(cpp_extension, "load", compile_stub)
    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # a compiler is found; the stub fails the way a broken one does
    monkeypatch.setattr(kernels, "_LOADED", {})
    return calls


def test_a_failed_build_warns_once_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The first layer tries the build once; it fails, the plain path runs and one warning names the failure; a later
    process (here: the loaded kernels forgotten) does not try again but warns the same; the explicit
    ``python -m seqnorm.kernels`` is the retry."""
    calls = _failing_compile(monkeypatch, tmp_path)
    layer = seqnorm.LSTM(3, 4, norm="layer")
    x = torch.randn(2, 1, 3)
    for process in range(2):
        monkeypatch.setattr(kernels, "_LOADED", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert layer.plan(x).path == "loop"
            layer(x)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1, messages
        assert "their last build failed: RuntimeError: Error building extension" in messages[0]
        assert "python -m seqnorm.kernels" in messages[0] and "plain-PyTorch path" in messages[0]
        assert calls == ["built"], process
    assert capsys.readouterr().err.count(NOTICE) == 1
    assert "their last build failed" in kernels.status()
    with pytest.raises(RuntimeError, match=r"Python\.h"):
        kernels.build()  # asked for explicitly: tried again
    assert calls == ["built", "built"]


def test_status_looks_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``seqnorm --version`` asks for the status: it must say what the first layer will do, not compile."""
    calls = _failing_compile(monkeypatch, tmp_path)
    status = kernels.status()
    assert status.startswith("off: the C++ kernels are not built") and "the first layer to use them builds" in status
    assert calls == [] and not list(tmp_path.iterdir())


# ---- a broken cache: checked before it is loaded, built again, never a crash -----------------------------------------


def _truncate(directory: Path) -> None:
    library = directory / "seqnorm_kernels.so"
    library.write_bytes(library.read_bytes()[:4096])  # mapped, it killed every process with a bus error


def _garbage(directory: Path) -> None:
    library = directory / "seqnorm_kernels.so"
    library.write_bytes(bytes(range(256)) * (library.stat().st_size // 256))


def _stale_torch(directory: Path) -> None:
    manifest = json.loads((directory / kernels.MANIFEST).read_text(encoding="utf-8"))
    manifest["torch"] = "2.13.0+cpu (a torch rebuilt from other sources under the same version)"
    (directory / kernels.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


DAMAGE = {
    "truncated": _truncate,
    "empty": lambda directory: (directory / "seqnorm_kernels.so").write_bytes(b""),
    "garbage": _garbage,
    "stale torch": _stale_torch,
    "no manifest": lambda directory: (directory / kernels.MANIFEST).unlink(),
    # the library gone, torch's ninja files and object file left: every process compiled, failed to rename into the
    # non-empty folder, threw its build away, said "built", then "not built"
    "half built": lambda directory: (directory / "seqnorm_kernels.so").unlink(),
}


def _stub_compile(monkeypatch: pytest.MonkeyPatch, cache: Path, library: Path) -> list[str]:
    """Builds in this process hand out the real library (as COMPILE_STUB does for other processes)."""
    from torch.utils import cpp_extension

    calls: list[str] = []

    def compile_stub(name: str, sources: list[str], build_directory: str, **kwargs: Any) -> None:
        calls.append(build_directory)
        shutil.copy(library, Path(build_directory) / "seqnorm_kernels.so")

    monkeypatch.setattr(cpp_extension, "load", compile_stub)
    monkeypatch.setenv("SEQNORM_KERNELS_DIR", str(cache))
    monkeypatch.setenv("CXX", sys.executable)
    return calls


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_broken_build_is_never_loaded_and_the_advice_builds_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built_library: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    calls = _stub_compile(monkeypatch, cache, built_library)
    directory = kernels.build().parent
    assert kernels.MANIFEST in {path.name for path in directory.iterdir()}
    DAMAGE[damage](directory)
    looked = subprocess.run(  # what `seqnorm --version` does: it died with exit code 135 (SIGBUS) on a truncated one
        [sys.executable, "-c", "from seqnorm import kernels; print(kernels.status())"],
        env=_environment(cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert looked.returncode == 0, looked.stderr
    if damage == "half built":
        assert looked.stdout.startswith("off: the C++ kernels are not built"), looked.stdout
    else:
        assert looked.stdout.startswith(f"off: the C++ kernels in {directory} fail their check ("), looked.stdout
        assert "rebuild them: `python -m seqnorm.kernels`" in looked.stdout
    from seqnorm.kernels.__main__ import main as build_command

    assert build_command([]) == 0  # the advice: it returned "built" at once when the library file existed
    assert len(calls) == 2 and kernels._broken(directory) is None
    assert (directory / "seqnorm_kernels.so").read_bytes() == built_library.read_bytes()
    assert sorted(path.name for path in cache.iterdir()) == [directory.name, f"{directory.name}.lock"]  # no leftovers


@pytest.mark.parametrize("compiler", [True, False])
def test_the_first_layer_builds_a_truncated_build_again_or_runs_the_plain_path(
    tmp_path: Path, built_library: Path, compiler: bool
) -> None:
    cache, record = tmp_path / "cache", tmp_path / "builds.txt"
    assert _first_layer(cache, built_library, record).returncode == 0
    (directory,) = [path for path in cache.iterdir() if path.is_dir()]
    _truncate(directory)
    again = _first_layer(cache, built_library, record, **({} if compiler else {"CXX": str(tmp_path / "no-compiler")}))
    assert again.returncode == 0, again.stderr
    if compiler:  # built again, once, saying why
        assert again.stdout.split() == ["kernel"] and _builds(record) == 2
        assert "the build there fails its check: seqnorm_kernels.so holds 4096 bytes" in again.stderr
    else:  # nothing to build with: the plain path, and the warning says why
        assert again.stdout.split() == ["loop"] and _builds(record) == 1
        assert (
            "fail their check (seqnorm_kernels.so holds 4096 bytes" in again.stderr and "RuntimeWarning" in again.stderr
        )


def test_force_builds_a_good_build_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built_library: Path) -> None:
    from seqnorm.kernels.__main__ import main as build_command

    calls = _stub_compile(monkeypatch, tmp_path / "cache", built_library)
    assert build_command([]) == 0 and build_command([]) == 0
    assert len(calls) == 1  # found, checked, kept
    assert build_command(["--force"]) == 0
    assert len(calls) == 2
