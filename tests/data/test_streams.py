"""Stream windows for stateful truncated BPTT: :mod:`seqnorm.data.streams` and ``TextCorpus(unit="stream")``."""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable

import pytest
import torch

from seqnorm.data import DataError, TextCorpus
from seqnorm.data.loader import ResumableDataLoader
from seqnorm.data.streams import StreamWindows, collate_stream, contiguous_streams, num_windows, stream_window


def test_contiguous_streams_cut_in_order_and_drop_the_remainder() -> None:
    streams = contiguous_streams(torch.arange(23), 4)
    assert streams.shape == (4, 5)
    assert torch.equal(streams.flatten(), torch.arange(20))  # rows are consecutive pieces; ids 20..22 dropped


@pytest.mark.parametrize(("length", "window", "expected"), [(10, 4, 3), (11, 4, 4), (2, 4, 1), (5, 2, 4)])
def test_num_windows_covers_every_target(length: int, window: int, expected: int) -> None:
    assert num_windows(length, window) == expected


@pytest.mark.parametrize(("length", "streams", "window"), [(103, 4, 7), (64, 2, 33), (50, 5, 2)])
def test_windows_continue_each_stream_and_predict_every_id_once(length: int, streams: int, window: int) -> None:
    ids = torch.randperm(length)
    rows = contiguous_streams(ids, streams)
    dataset = StreamWindows(rows, window)
    batches = [collate_stream([dataset[k]]) for k in range(len(dataset))]
    for k, (batch, following) in enumerate(itertools.pairwise(batches)):
        assert int(batch["window"]) == k
        # row b of batch k+1 starts where row b of batch k's targets ended
        assert torch.equal(following["inputs"][:, 0], batch["targets"][:, -1])
    for b in range(streams):
        targets = torch.cat([batch["targets"][b] for batch in batches])
        inputs = torch.cat([batch["inputs"][b] for batch in batches])
        assert torch.equal(targets, rows[b, 1:])  # every id after the first, exactly once, in order
        assert torch.equal(inputs, rows[b, :-1])
    assert all(torch.equal(b["lengths"], torch.full((streams,), b["inputs"].shape[1])) for b in batches)
    assert [int(b["start"]) for b in batches] == [k * (window - 1) for k in range(len(batches))]


def test_stream_errors() -> None:
    with pytest.raises(DataError, match=r"--data\.batch_size 4\): lower --data\.batch_size or add text$"):
        contiguous_streams(torch.arange(7), 4)
    with pytest.raises(DataError, match=r"--data\.batch_size 1\): add text$"):  # not "lower" what is already 1
        contiguous_streams(torch.arange(1), 1)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        stream_window(torch.zeros(2, 10, dtype=torch.long), 3, 4)
    with pytest.raises(DataError, match="one stream window, got 2"):
        collate_stream([(torch.zeros(1, 1), torch.zeros(1, 1), 0, 0)] * 2)


def _text(length: int) -> str:
    alphabet = string.ascii_lowercase + " \n"
    generator = torch.Generator().manual_seed(0)
    return "".join(alphabet[i] for i in torch.randint(len(alphabet), (length,), generator=generator).tolist())


def test_text_corpus_streams_every_split_in_order(write: Callable[..., str]) -> None:
    text = _text(2000)
    corpus = TextCorpus(path=write("s.txt", text), unit="stream", batch_size=3, window_length=17, seed=5)
    tokens = corpus.vocab.tokens
    for loader, split in ((corpus.train_dataloader(), text[:1600]), (corpus.val_dataloader(), text[1600:1800])):
        assert isinstance(loader, ResumableDataLoader)
        batches = list(loader)
        assert [int(b["window"]) for b in batches] == list(range(len(batches)))  # in order, no shuffling
        assert set(batches[0]) == {"inputs", "targets", "lengths", "window", "start", "first_stream", "num_streams"}
        assert all(int(b["first_stream"]) == 0 and int(b["num_streams"]) == 3 for b in batches)
        assert all(b["inputs"].shape[0] == 3 for b in batches)
        # row b's targets are the b-th third of the split (remainder dropped), newlines included
        per_stream = len(split) // 3
        for b in range(3):
            decoded = "".join(tokens[i] for i in torch.cat([batch["targets"][b] for batch in batches]).tolist())
            assert decoded == split[b * per_stream + 1 : (b + 1) * per_stream]
    # the same order every epoch
    first = [b["inputs"] for b in corpus.train_dataloader()]
    loader = corpus.train_dataloader()
    loader.batch_sampler.set_epoch(1)
    assert all(torch.equal(a, b["inputs"]) for a, b in zip(first, loader, strict=True))


def test_text_corpus_stream_resumes_at_the_next_window(write: Callable[..., str]) -> None:
    corpus = TextCorpus(path=write("s.txt", _text(1000)), unit="stream", batch_size=2, window_length=9)
    loader = corpus.train_dataloader()
    iterator = iter(loader)
    taken = [next(iterator) for _ in range(5)]
    state = loader.state_dict()
    resumed = corpus.train_dataloader()
    resumed.load_state_dict(state)
    following = next(iter(resumed))
    assert int(following["window"]) == 5
    assert torch.equal(following["inputs"][:, 0], taken[-1]["targets"][:, -1])


def test_a_split_too_short_for_the_streams_names_the_flag(write: Callable[..., str]) -> None:
    # 1000 characters: 10 for validation, too few for 8 streams of 2
    corpus = TextCorpus(path=write("s.txt", _text(1000)), unit="stream", batch_size=8, val_fraction=0.01)
    with pytest.raises(DataError, match=r"the val split: .*--data\.batch_size 8"):
        corpus.setup()


def test_streams_without_validation_text_train_without_validation(tmp_path) -> None:
    """--data.val_fraction 0 with streams: no validation, as with line units (it stopped fit with "no val text")."""
    from seqnorm.data import TextCorpus

    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 200, encoding="utf-8")
    corpus = TextCorpus(
        path=str(tmp_path / "text.txt"),
        unit="stream",
        batch_size=2,
        window_length=9,
        val_fraction=0.0,
        test_fraction=0.0,
    )
    assert len(corpus.val_dataloader()) == 0 and len(corpus.train_dataloader()) > 0
    with pytest.raises(DataError, match="no test text"):
        corpus.test_dataloader()


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    """What ``torch.distributed`` answers inside process ``rank`` of a DDP run of ``world_size`` processes."""
    from seqnorm.data import sampler

    monkeypatch.setattr(sampler.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler.dist, "get_world_size", lambda: world_size)
    monkeypatch.setattr(sampler.dist, "get_rank", lambda: rank)


@pytest.mark.parametrize("split", ["train", "val", "test", "predict"])
def test_each_process_reads_every_window_of_its_own_streams(
    write: Callable[..., str], monkeypatch: pytest.MonkeyPatch, split: str
) -> None:
    """Under DDP the B streams are shared out (it refused: "--data.unit stream: expected one process, got 2"):
    process r of W reads rows r*B/W .. of every window, so the W processes read the batches of one process."""
    path = write("s.txt", _text(3000))

    def batches() -> list[dict[str, torch.Tensor]]:
        corpus = TextCorpus(path=path, unit="stream", batch_size=6, window_length=17)
        return list(getattr(corpus, f"{split}_dataloader")())

    whole = batches()
    shares = []
    for rank in range(3):
        _as_rank(monkeypatch, rank, 3)
        shares.append(batches())
    for rank, share in enumerate(shares):
        assert len(share) == len(whole)  # every window: the same steps on every process, and a carry per stream
        for own, full in zip(share, whole, strict=True):
            assert torch.equal(own["inputs"], full["inputs"][2 * rank : 2 * rank + 2])
            assert torch.equal(own["targets"], full["targets"][2 * rank : 2 * rank + 2])
            assert (int(own["window"]), int(own["start"])) == (int(full["window"]), int(full["start"]))
            assert (int(own["first_stream"]), int(own["num_streams"])) == (2 * rank, 6)


def test_streams_not_shared_evenly_name_the_batch_size_and_world_size(
    write: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = TextCorpus(path=write("s.txt", _text(1000)), unit="stream", batch_size=5, window_length=9)
    _as_rank(monkeypatch, 1, 2)
    expected = r"--data\.batch_size 5 .*multiple of the world size 2.*pass --data\.batch_size 4 or 6"
    with pytest.raises(DataError, match=expected):
        corpus.train_dataloader()
