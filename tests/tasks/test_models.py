"""The task models of seqnorm.models: output layers sized by what the RNN returns (proj_size when set)."""

from __future__ import annotations

import pytest
import torch

from seqnorm.models import RNNClassifier, RNNLanguageModel


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_language_model_with_a_projection_sizes_its_output_by_proj_size(norm: str) -> None:
    """--model.rnn_options '{"proj_size": 8}' failed with "mat1 and mat2 shapes cannot be multiplied"."""
    model = RNNLanguageModel(25, embedding_dim=8, hidden_size=16, norm=norm, proj_size=8, tie_weights=True)
    inputs = torch.randint(0, 25, (3, 7))
    logits = model(inputs, torch.tensor([7, 4, 2]))
    assert logits.shape == (3, 7, 25)
    assert model.projection.weight is model.embedding.weight  # tied through the projection's size
    logits.sum().backward()
    with pytest.raises(ValueError, match=r"expected embedding_dim == proj_size with tie_weights, got 16 and 8"):
        RNNLanguageModel(25, embedding_dim=16, hidden_size=16, proj_size=8, tie_weights=True)
    with pytest.raises(ValueError, match=r"expected embedding_dim == hidden_size with tie_weights, got 8 and 16"):
        RNNLanguageModel(25, embedding_dim=8, hidden_size=16, tie_weights=True)


@pytest.mark.parametrize("pooling", ["last", "mean", "max"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_classifier_with_a_projection(pooling: str, bidirectional: bool) -> None:
    model = RNNClassifier(
        25, 3, embedding_dim=8, hidden_size=16, pooling=pooling, bidirectional=bidirectional, proj_size=6
    )
    scores = model(torch.randint(1, 25, (4, 5)), torch.tensor([5, 3, 1, 4]))
    assert scores.shape == (4, 3) and torch.isfinite(scores).all()
