"""The dataset registry: real checksums, refusal without one, and downloads served from a loopback HTTP server.

Nothing here reaches the internet: the server runs on 127.0.0.1 in a thread and serves files from ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import zipfile
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from seqnorm.data import DATASETS, DataError, DatasetSpec, Download, SplitFile, TextCorpus, fetch_dataset
from seqnorm.data.formats import ptb_char_to_text
from seqnorm.data.registry import MANIFEST, default_cache_dir

CORPUS = "".join(f"the quick brown fox {i}\n" for i in range(30))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """``(base_url, served_dir)`` of an HTTP server on 127.0.0.1, stopped after the test."""
    served = tmp_path / "served"
    served.mkdir()
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # a proxy must not intercept loopback requests
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def _register(monkeypatch: pytest.MonkeyPatch, spec: DatasetSpec) -> None:
    monkeypatch.setitem(DATASETS, spec.name, spec)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_registered_checksums_are_well_formed() -> None:
    assert {"ptb_char", "ptb_word", "wikitext2", "tiny_shakespeare", "text8"} <= set(DATASETS)
    for spec in DATASETS.values():
        assert "train" in spec.splits
        for download in spec.downloads:
            assert download.url.startswith(("http://", "https://"))
            if download.known_hash is None:
                continue
            assert re.fullmatch(r"[0-9a-f]{64}|md5:[0-9a-f]{32}", download.known_hash), download
            assert download.hash_source


def test_dataset_without_checksum_is_refused_before_any_download(tmp_path: Path) -> None:
    corpus = TextCorpus(dataset="text8", cache_dir=str(tmp_path))
    assert corpus.level == "char" and corpus.unit == "window"
    with pytest.raises(DataError, match=r"--data\.dataset_hash"):
        corpus.prepare_data()
    assert not any(tmp_path.rglob("*.zip"))


def test_dataset_defaults_can_be_overridden() -> None:
    assert TextCorpus(dataset="ptb_word").level == "word"
    assert TextCorpus(dataset="ptb_word", level="char").level == "char"
    assert TextCorpus(dataset="tiny_shakespeare").unit == "paragraph"


def test_checksum_mismatch_leaves_no_partial_file(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, served = server
    (served / "corpus.txt").write_text(CORPUS)
    wrong = _sha256(b"something else")
    _register(
        monkeypatch, DatasetSpec("local", "test", {"train": SplitFile(Download(f"{base_url}/corpus.txt", wrong))})
    )
    cache = tmp_path / "cache"
    corpus = TextCorpus(dataset="local", cache_dir=str(cache), batch_size=2)
    with pytest.raises(DataError) as caught:
        _ = corpus.vocab_size
    message = str(caught.value)
    assert "checksum mismatch" in message and "holds no partial file" in message and "corpus.txt" in message
    assert [path for path in cache.rglob("*") if path.is_file()] == []
    # A stale cached copy that fails the check is not kept either.
    (cache / "local").mkdir(parents=True, exist_ok=True)
    (cache / "local" / "corpus.txt").write_text("stale")
    with pytest.raises(DataError, match="checksum mismatch"):
        fetch_dataset("local", cache)
    assert [path for path in cache.rglob("*") if path.is_file()] == []


def test_verified_download_loads_as_a_corpus_and_is_cached(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, served = server
    (served / "corpus.txt").write_text(CORPUS)
    download = Download(f"{base_url}/corpus.txt", _sha256(CORPUS.encode()), "computed in this test")
    _register(monkeypatch, DatasetSpec("local", "test", {"train": SplitFile(download)}, level="word"))
    cache = tmp_path / "cache"
    corpus = TextCorpus(dataset="local", cache_dir=str(cache), batch_size=4)
    corpus.prepare_data()
    assert (cache / "local" / "corpus.txt").read_text() == CORPUS
    assert corpus.vocab.tokens[4:8] == ["brown", "fox", "quick", "the"]
    assert {split: len(d) for split, d in corpus.datasets.items()} == {"train": 24, "val": 3, "test": 3}
    (served / "corpus.txt").unlink()  # a second run uses the verified cached copy
    assert fetch_dataset("local", cache) == {"train": cache / "local" / "corpus.txt"}
    assert json.loads((cache / "local" / MANIFEST).read_text()) == {"corpus.txt": _sha256(CORPUS.encode())}


def test_archive_members_become_splits(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, served = server
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in ("train", "valid", "test"):
            archive.writestr(f"corpus/{name}.txt", f"{name} text\n" * 5)
    (served / "corpus.zip").write_bytes(buffer.getvalue())
    download = Download(f"{base_url}/corpus.zip", f"md5:{hashlib.md5(buffer.getvalue()).hexdigest()}", "test")
    splits = {"train": "train", "val": "valid", "test": "test"}
    spec = DatasetSpec(
        "zipped", "test", {split: SplitFile(download, f"corpus/{name}.txt") for split, name in splits.items()}
    )
    _register(monkeypatch, spec)
    paths = fetch_dataset("zipped", tmp_path / "cache")
    assert {split: path.read_text().split("\n")[0] for split, path in paths.items()} == {
        "train": "train text", "val": "valid text", "test": "test text"}  # fmt: skip
    corpus = TextCorpus(dataset="zipped", cache_dir=str(tmp_path / "cache"), level="word", batch_size=5)
    assert [len(corpus.datasets[split]) for split in ("train", "val", "test")] == [5, 5, 5]
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_explicit_hash_allows_a_dataset_without_one(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, served = server
    (served / "corpus.txt").write_text(CORPUS)
    _register(
        monkeypatch, DatasetSpec("nohash", "test", {"train": SplitFile(Download(f"{base_url}/corpus.txt", None))})
    )
    with pytest.raises(DataError, match="no published checksum"):
        fetch_dataset("nohash", tmp_path)
    sha = f"sha256:{_sha256(CORPUS.encode())}"
    corpus = TextCorpus(dataset="nohash", cache_dir=str(tmp_path), dataset_hash=sha, batch_size=2)
    assert corpus.vocab_size > 4


def test_unreachable_server_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    # Port 9 (discard) on loopback: nothing listens, so the connection is refused at once.
    _register(
        monkeypatch, DatasetSpec("dead", "test", {"train": SplitFile(Download("http://127.0.0.1:9/x.txt", "0" * 64))})
    )
    with pytest.raises(DataError, match="could not download"):
        fetch_dataset("dead", tmp_path)
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_a_cached_copy_failing_its_checksum_offline_is_named_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pooch re-downloads a cached file that fails its hash; offline, the error was "could not download", about a
    file that was there, and the bad copy stayed."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    _register(
        monkeypatch, DatasetSpec("dead", "test", {"train": SplitFile(Download("http://127.0.0.1:9/x.txt", "0" * 64))})
    )
    with pytest.raises(DataError):
        fetch_dataset("dead", tmp_path)  # where the cache puts it
    folder = next(path for path in tmp_path.rglob("*") if path.is_dir())
    tampered = folder / "x.txt"
    tampered.write_text("not the published file")
    with pytest.raises(DataError, match=rf"the cached {re.escape(str(tampered))} does not match its checksum"):
        fetch_dataset("dead", tmp_path)
    assert not tampered.exists()


def test_a_dataset_folder_that_links_out_of_the_cache_is_refused_and_nothing_behind_it_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied cache whose ``<dataset>`` folder links elsewhere: the copy there failing its check was deleted
    through the link (offline; online, pooch would have written the download there)."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    _register(
        monkeypatch, DatasetSpec("dead", "test", {"train": SplitFile(Download("http://127.0.0.1:9/x.txt", "0" * 64))})
    )
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.txt").write_text("precious\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "dead").symlink_to(victim)
    with pytest.raises(DataError) as caught:
        fetch_dataset("dead", cache)
    assert str(caught.value).startswith(
        f"--data.dataset dead: expected {cache / 'dead'} to be a folder of the cache, got a link to {victim};"
    )
    assert [path.name for path in victim.iterdir()] == ["x.txt"] and (victim / "x.txt").read_text() == "precious\n"


def test_a_cached_copy_failing_its_checksum_in_the_built_in_cache_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a cache the user named has files deleted or replaced: in ``~/.cache/seqnorm`` a copy that fails its check
    stays as it is, nothing is downloaded over it, and the error says what to do."""
    monkeypatch.delenv("SEQNORM_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    _register(
        monkeypatch, DatasetSpec("dead", "test", {"train": SplitFile(Download("http://127.0.0.1:9/x.txt", "0" * 64))})
    )
    folder = default_cache_dir() / "dead"
    assert folder.is_relative_to(tmp_path)
    folder.mkdir(parents=True)
    kept = folder / "x.txt"
    kept.write_text("someone's own file")
    with pytest.raises(DataError) as caught:
        fetch_dataset("dead")
    assert str(caught.value) == (
        f"--data.dataset dead: the cached {kept} does not match its checksum ({'0' * 64}); seqnorm deletes or "
        "replaces files only in a cache you name: check it, then delete it and run again (or pass --data.cache_dir "
        "FOLDER)"
    )
    assert list(folder.iterdir()) == [kept] and kept.read_text() == "someone's own file"


def test_ptb_char_files_become_plain_text() -> None:
    assert ptb_char_to_text(" a e r _ b a n k \n n o _ i t \n") == "aer bank\nno it\n"


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SEQNORM_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SEQNORM_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "seqnorm"


def _serve_zip(served: Path, texts: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in texts.items():
            archive.writestr(f"corpus/{name}.txt", text)
    (served / "corpus.zip").write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _register_md5_zip(monkeypatch: pytest.MonkeyPatch, base_url: str, archive: bytes) -> None:
    """A dataset like ptb_char: splits inside a zip whose only published checksum is an MD5."""
    download = Download(f"{base_url}/corpus.zip", f"md5:{hashlib.md5(archive).hexdigest()}", "test")
    splits = {split: SplitFile(download, f"corpus/{split}.txt") for split in ("train", "val")}
    _register(monkeypatch, DatasetSpec("zipped", "test", splits))


TEXTS = {"train": "train text\n" * 5, "val": "val text\n" * 5}


def _fetch_served_zip(
    server: tuple[str, Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, bytes, dict[str, Path]]:
    """Serve an MD5-only zip of :data:`TEXTS`, fetch it into ``cache``: (served folder, archive, split paths)."""
    base_url, served = server
    archive = _serve_zip(served, TEXTS)
    _register_md5_zip(monkeypatch, base_url, archive)
    return served, archive, fetch_dataset("zipped", cache)


def test_cached_files_are_recorded_and_a_changed_member_is_extracted_again(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    served, archive, paths = _fetch_served_zip(server, cache, monkeypatch)
    texts = TEXTS
    manifest = json.loads((cache / "zipped" / MANIFEST).read_text())
    assert manifest == {
        "corpus.zip": _sha256(archive),
        "train.txt": _sha256(texts["train"].encode()),
        "val.txt": _sha256(texts["val"].encode()),
    }
    (served / "corpus.zip").unlink()  # from here on only the cache can serve it
    paths["train"].write_text("tampered\n")
    assert fetch_dataset("zipped", cache)["train"].read_text() == texts["train"]
    paths["val"].unlink()
    assert fetch_dataset("zipped", cache)["val"].read_text() == texts["val"]


def test_links_planted_in_a_cache_are_replaced_not_written_through(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    _, _, paths = _fetch_served_zip(server, cache, monkeypatch)
    outside = tmp_path / "outside.txt"
    outside.write_text("mine\n")
    # a cache one was given: the member and the old temporary name both link to a file outside it
    paths["train"].unlink()
    paths["train"].symlink_to(outside)
    paths["train"].with_name("train.txt.part").symlink_to(outside)
    assert fetch_dataset("zipped", cache)["train"].read_text() == TEXTS["train"]
    assert outside.read_text() == "mine\n" and not paths["train"].is_symlink()
    umask = os.umask(0)
    os.umask(umask)
    assert paths["train"].stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes files, not mkstemp's 0600


def test_changed_cached_archive_is_fetched_again(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    _, archive, paths = _fetch_served_zip(server, cache, monkeypatch)
    (cache / "zipped" / "corpus.zip").write_bytes(b"tampered archive")
    paths["train"].unlink()  # so that the archive is needed again
    assert fetch_dataset("zipped", cache)["train"].read_text() == TEXTS["train"]
    assert (cache / "zipped" / "corpus.zip").read_bytes() == archive


def test_archive_passing_its_md5_but_not_its_recorded_sha256_is_refused(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_url, served = server
    _register_md5_zip(monkeypatch, base_url, _serve_zip(served, {"train": "first\n" * 5, "val": "first\n" * 5}))
    cache = tmp_path / "cache"
    paths = fetch_dataset("zipped", cache)
    # Another archive that passes the published check, as an MD5 collision would: served and cached alike.
    replaced = _serve_zip(served, {"train": "second\n" * 5, "val": "second\n" * 5})
    _register_md5_zip(monkeypatch, base_url, replaced)
    (cache / "zipped" / "corpus.zip").write_bytes(replaced)
    paths["train"].unlink()
    with pytest.raises(DataError) as caught:
        fetch_dataset("zipped", cache)
    message = str(caught.value)
    assert "corpus.zip" in message and MANIFEST in message and _sha256(replaced) in message
    assert not (cache / "zipped" / "corpus.zip").exists() and not paths["train"].exists()
