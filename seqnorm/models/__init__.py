"""Plain ``nn.Module`` task models built on the seqnorm layers (no Lightning here)."""

from seqnorm.models.classifier import Pooling, RNNClassifier
from seqnorm.models.language_model import RNNLanguageModel
from seqnorm.models.rnn import CellName, build_rnn

__all__ = ["CellName", "Pooling", "RNNClassifier", "RNNLanguageModel", "build_rnn"]
