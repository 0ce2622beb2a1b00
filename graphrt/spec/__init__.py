"""Speculative decoding: the configuration and the draft proposers (the verify step lives in the
runner, beside the main step)."""

from graphrt.spec.config import SpeculativeConfig
from graphrt.spec.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
