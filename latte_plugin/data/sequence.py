"""A generated sequence task whose label needs attention across the sequence: marked-token retrieval.

Each sequence is ``[CLS, t_1, ..., t_{L-1}]``: content tokens drawn uniformly from
``0..vocab-1``, except one position ``p`` that holds a *marked* token ``vocab + v`` (a second
copy of the vocabulary). The label is the marked token's value ``v``. The classifier reads the
``CLS`` output, so ``CLS`` must find the one marked token anywhere in the sequence; the
uniform-attention control (every layer averages its values) dilutes it among ``L`` tokens.

Deterministic: the same seed gives the same tensors.
"""
from __future__ import annotations

import torch

__all__ = ["retrieval_batch", "RetrievalSpec"]


class RetrievalSpec:
    """Sizes of the task: ``vocab`` content tokens, ``vocab`` marked tokens, then ``CLS``; ``length`` tokens."""

    def __init__(self, vocab: int = 16, length: int = 64) -> None:
        self.vocab, self.length = vocab, length
        self.cls = 2 * vocab
        self.num_tokens = 2 * vocab + 1


def retrieval_batch(spec: RetrievalSpec, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (size, length) int64, labels (size,) int64)`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (size, spec.length), generator=g)
    tokens[:, 0] = spec.cls
    pos = torch.randint(1, spec.length, (size,), generator=g)
    labels = torch.randint(0, spec.vocab, (size,), generator=g)
    tokens[torch.arange(size), pos] = spec.vocab + labels
    return tokens, labels
