"""Lightning callbacks that observe seqnorm models in TensorBoard; they hold no training logic."""

from seqnorm.callbacks.hidden_state_stats import HiddenStateStats

__all__ = ["HiddenStateStats"]
