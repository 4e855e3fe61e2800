"""Stateful truncated BPTT: a state carried across windows equals one long sequence, up to detaching.

Layers: ``forward(chunk, hx, first_step=k)`` continues a sequence. ``LanguageModel``: stream windows (batches with a
``window`` index) start from the previous window's detached final state, per stage, from zeros at window 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import seqnorm
from seqnorm.cli import main
from seqnorm.data.streams import StreamWindows, collate_stream, contiguous_streams
from seqnorm.layers import LAYERS
from seqnorm.lightning import LanguageModel
from seqnorm.lightning.language_model import STREAM_STATE_KEY
from tests.conftest import QUIET

STEPS, SPLIT = 12, 5


@pytest.fixture
def float64() -> Iterator[None]:
    """Parity in float64, so that 1e-9 tolerances compare the math, not rounding."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _randomize_statistics(module: torch.nn.Module) -> None:
    """Distinct running statistics per step, so that the step index changes what BN computes."""
    generator = torch.Generator().manual_seed(1)
    for name, buffer in module.named_buffers():
        if name.endswith("running_mean"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        elif name.endswith("running_var"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) + 0.5)


def _layer(kind: str, norm: str) -> seqnorm.LSTM:
    torch.manual_seed(0)
    layer = LAYERS[kind](3, 4, num_layers=2, batch_first=True, norm=norm, max_steps=STEPS)
    if norm == "batch":
        _randomize_statistics(layer)
        layer.eval()  # in training, batch statistics of a chunk are not those of the whole sequence
    return layer


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("norm", ["none", "layer", "batch"])
def test_layer_continues_a_sequence_from_first_step(kind: str, norm: str) -> None:
    layer = _layer(kind, norm)
    x = torch.randn(2, STEPS, 3)
    whole, final = layer(x)
    head, state = layer(x[:, :SPLIT])
    tail, continued = layer(x[:, SPLIT:], state, first_step=SPLIT)
    assert_close(torch.cat([head, tail], 1), whole, rtol=1e-9, atol=1e-9)
    assert_close(continued, final, rtol=1e-9, atol=1e-9)
    if norm == "batch":  # the offset matters: restarting at step 0 uses other statistics
        restarted, _ = layer(x[:, SPLIT:], state)
        assert not torch.allclose(restarted, tail)
        assert layer.plan(x[:, SPLIT:], state, first_step=SPLIT).path == "reference"


def test_layer_first_step_errors() -> None:
    layer = seqnorm.LSTM(3, 4, bidirectional=True)
    with pytest.raises(ValueError, match="LSTM: expected first_step=0 with bidirectional=True, got 2"):
        layer(torch.randn(5, 1, 3), first_step=2)
    with pytest.raises(ValueError, match="LSTM: expected first_step to be an int >= 0, got -1"):
        seqnorm.LSTM(3, 4)(torch.randn(5, 1, 3), first_step=-1)


def _stream_batches(ids: torch.Tensor, streams: int, window_length: int) -> list[dict[str, torch.Tensor]]:
    dataset = StreamWindows(contiguous_streams(ids, streams), window_length)
    return [collate_stream([dataset[k]]) for k in range(len(dataset))]


def _model(cell: str, norm: str, **kwargs: object) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(11, cell=cell, norm=norm, hidden_size=6, embedding_dim=5, num_layers=2, **kwargs)
    if norm == "batch":
        _randomize_statistics(model)
        model.eval()
    return model


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("norm", ["none", "layer", "batch"])
def test_carried_state_equals_one_long_sequence(cell: str, norm: str) -> None:
    # per-timestep BN sees the stream position only with stream_steps="continue"
    model = _model(cell, norm, norm_max_steps=40, stream_steps="continue")
    ids = torch.randint(4, 11, (3 * 31,))
    streams = contiguous_streams(ids, 3)  # (3, 31)
    batches = _stream_batches(ids, 3, 8)  # windows of 7 steps: 7, 7, 7, 7, 2
    pieces = [model._logits(batch, "val") for batch in batches]
    whole, final = model.model.forward_with_state(streams[:, :-1])
    assert_close(torch.cat(pieces, 1), whole, rtol=1e-9, atol=1e-9)
    carried = model.carried["val"]
    if cell == "gru":
        carried, final = (carried,), (final,)
    for got, expected in zip(carried, final, strict=True):
        assert_close(got, expected, rtol=1e-9, atol=1e-9)
        assert not got.requires_grad  # detached: no gradient crosses a window boundary


@pytest.mark.usefixtures("float64")
def test_restart_numbers_every_window_from_zero() -> None:
    model = _model("lstm", "batch", norm_max_steps=40)  # stream_steps="restart"
    ids = torch.randint(4, 11, (2 * 15,))
    first, second = _stream_batches(ids, 2, 8)
    model._logits(first, "val")
    state = model.carried["val"]
    logits = model._logits(second, "val")
    assert_close(logits, model.model.forward_with_state(second["inputs"], None, state)[0], rtol=1e-9, atol=1e-9)
    continued = model.model.forward_with_state(second["inputs"], None, state, first_step=7)[0]
    assert not torch.allclose(logits, continued)


@pytest.mark.usefixtures("float64")
def test_gradients_stop_at_the_window_boundary() -> None:
    model = _model("lstm", "layer")
    model.train()
    batches = _stream_batches(torch.randint(4, 11, (2 * 22,)), 2, 8)
    model._logits(batches[0], "train")
    state = model.carried["train"]
    loss = model._loss(batches[1], "train")[0]
    gradients = torch.autograd.grad(loss, list(model.parameters()))
    # the same loss from the state as a constant: the same gradients, so nothing flowed into window 0
    model.carried["train"] = tuple(t.clone() for t in state)
    expected = torch.autograd.grad(model._loss(batches[1], "train")[0], list(model.parameters()))
    for got, want in zip(gradients, expected, strict=True):
        assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("float64")
def test_window_zero_starts_from_zeros_and_stages_keep_their_own_state() -> None:
    model = _model("gru", "layer")
    batches = _stream_batches(torch.randint(4, 11, (2 * 22,)), 2, 8)
    fresh = model.model(batches[0]["inputs"])
    for batch in batches:
        model._logits(batch, "train")
    model._logits(batches[0], "val")
    val_state = model.carried["val"]
    assert_close(model._logits(batches[0], "train"), fresh, rtol=1e-12, atol=1e-12)  # the next epoch's window 0
    assert model.carried["val"] is val_state
    second = model._logits(batches[1], "val")  # continues the val stream, not the train one
    assert_close(second, model.model.forward_with_state(batches[1]["inputs"], None, val_state)[0])


@pytest.mark.usefixtures("float64")
def test_carry_round_trips_through_the_checkpoint_hooks() -> None:
    model = _model("lstm", "layer")
    batches = _stream_batches(torch.randint(4, 11, (2 * 22,)), 2, 8)
    model._logits(batches[0], "train")
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    restored = _model("lstm", "layer")
    restored.on_load_checkpoint(checkpoint)
    assert set(checkpoint[STREAM_STATE_KEY]["train"]) == {"h", "c"}
    assert_close(restored._logits(batches[1], "train"), model._logits(batches[1], "train"), rtol=0, atol=0)


@pytest.mark.usefixtures("float64")
def test_a_process_takes_its_own_streams_of_a_saved_carry() -> None:
    """A checkpoint holds every stream's carry; a process reading streams 2..3 of 4 (DDP's rank 1 of 2) continues
    from those rows, and a run with another number of streams starts from zeros."""
    model = _model("lstm", "layer")
    ids = torch.randint(4, 11, (4 * 22,))
    whole = StreamWindows(contiguous_streams(ids, 4), 8)
    model._logits(collate_stream([whole[0]]), "train")
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    own = whole.share(2, 1)
    restored = _model("lstm", "layer")
    restored.on_load_checkpoint(checkpoint)
    expected = model._logits(collate_stream([whole[1]]), "train")[2:]
    assert_close(restored._logits(collate_stream([own[1]]), "train"), expected, rtol=1e-12, atol=1e-12)
    assert_close(restored.carried["train"][0], model.carried["train"][0][:, 2:], rtol=1e-12, atol=1e-12)
    other = StreamWindows(contiguous_streams(ids, 8), 8).share(2, 1)  # --data.batch_size 8: other streams
    restored.on_load_checkpoint(checkpoint)
    from_zeros = restored.model(other[1][0])
    assert_close(restored._logits(collate_stream([other[1]]), "train"), from_zeros, rtol=1e-12, atol=1e-12)


def test_cli_trains_on_stream_windows(tmp_path: Path) -> None:
    text = "".join(f"line {i % 7} of a small corpus, said the {('cat', 'dog')[i % 2]}.\n" for i in range(300))
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    args = ["fit", "--model", "LanguageModel", "--data", "TextCorpus", "--data.path", str(tmp_path / "c.txt")]
    args += ["--data.unit", "stream", "--data.batch_size", "4", "--data.window_length", "33"]
    args += ["--model.hidden_size", "16", "--model.embedding_dim", "8", "--model.norm", "batch"]
    args += ["--model.stream_steps", "continue", "--trainer.max_steps", "12", "--trainer.logger", "false"]
    args += ["--trainer.default_root_dir", str(tmp_path / "run"), *QUIET]
    main(args)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["stream_steps"] == "continue"
    h, c = checkpoint[STREAM_STATE_KEY]["train"]["h"], checkpoint[STREAM_STATE_KEY]["train"]["c"]
    assert h.shape == c.shape == (1, 4, 16) and h.abs().sum() > 0
