"""A generated sequence task whose label needs long-range attention: marker retrieval.

Each sequence is ``[CLS, t_1, ..., t_{L-1}]`` with content tokens drawn uniformly from
``0..vocab-1`` and one ``MARK`` token at a random position ``p``; the label is the token right
after the marker, ``t_{p+1}``. The classifier reads the ``CLS`` output, so the model must
find the marker anywhere in the sequence and carry its neighbour back to ``CLS``: attention
that averages over the sequence (the uniform control) is at chance, ``1 / vocab``.

Deterministic: the same seed gives the same tensors.
"""
from __future__ import annotations

import torch

__all__ = ["retrieval_batch", "RetrievalSpec"]


class RetrievalSpec:
    """Sizes of the task: ``vocab`` content tokens, then ``MARK`` and ``CLS``; ``length`` tokens."""

    def __init__(self, vocab: int = 16, length: int = 64) -> None:
        self.vocab, self.length = vocab, length
        self.mark, self.cls = vocab, vocab + 1
        self.num_tokens = vocab + 2


def retrieval_batch(spec: RetrievalSpec, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (size, length) int64, labels (size,) int64)`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (size, spec.length), generator=g)
    tokens[:, 0] = spec.cls
    pos = torch.randint(1, spec.length - 1, (size,), generator=g)  # the marker is never last
    rows = torch.arange(size)
    tokens[rows, pos] = spec.mark
    return tokens, tokens[rows, pos + 1].clone()
