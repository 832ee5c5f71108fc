#!/usr/bin/env python
"""The non-detection model of the evidence: a small transformer encoder trained here on the
generated marker-retrieval task (:mod:`latte_plugin.data.sequence`).

    python -m experiments.sequence_task train [--steps 3000] [--out checkpoints/seq_retrieval.safetensors]
    python -m experiments.sequence_task eval [--checkpoint ...]

The model is plain PyTorch: token + learned position embeddings, ``nn.TransformerEncoder``
(6 pre-norm layers, d=64, 4 heads, ``nn.MultiheadAttention`` inside, so the generic entry
``latte_plugin.linearize`` swaps it), and a linear classifier on the ``CLS`` output. Weights
are saved with safetensors (fp32, about 1 MB). Training data are generated on the fly from
seeds 1000+; the test set (seed 7) and calibration sequences (seed 3) are never trained on.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from latte_plugin.data.sequence import RetrievalSpec, retrieval_batch  # noqa: E402

CHECKPOINT = os.path.join(ROOT, "checkpoints", "seq_retrieval.safetensors")
TEST_SEED, CALIB_SEED = 7, 3


class RetrievalEncoder(nn.Module):
    """``tokens (B, L) -> (logits (B, vocab), pooled (B, d))``."""

    def __init__(self, spec: RetrievalSpec, dim: int = 64, heads: int = 4, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.num_tokens, dim)
        self.pos = nn.Parameter(torch.randn(spec.length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, spec.vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]])
        pooled = self.norm(x[:, 0])
        return self.head(pooled), pooled


def load(path: str = CHECKPOINT) -> RetrievalEncoder:
    from safetensors.torch import load_file

    model = RetrievalEncoder(RetrievalSpec())
    model.load_state_dict(load_file(path))
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, size: int = 2000, seed: int = TEST_SEED, batch: int = 500) -> float:
    spec, hits = RetrievalSpec(), 0
    tokens, labels = retrieval_batch(spec, size, seed)
    for i in range(0, size, batch):
        hits += int((model(tokens[i:i + batch])[0].argmax(-1) == labels[i:i + batch]).sum())
    return hits / size


def train(steps: int, out: str, batch: int = 64, lr: float = 1e-3, log_every: int = 250) -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    spec = RetrievalSpec()
    model = RetrievalEncoder(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    t0, log = time.time(), []
    for step in range(1, steps + 1):
        tokens, labels = retrieval_batch(spec, batch, 1000 + step)
        loss = nn.functional.cross_entropy(model(tokens)[0], labels)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            model.eval()
            acc = accuracy(model, 500)
            model.train()
            log.append({"step": step, "loss": round(float(loss.detach()), 4), "test_acc_500": acc,
                        "seconds": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    model.eval()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    return {"steps": steps, "seconds": round(time.time() - t0, 1), "test_accuracy": accuracy(model), "log": log}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["train", "eval"])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out", default=CHECKPOINT)
    p.add_argument("--checkpoint", default=CHECKPOINT)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    if a.what == "train":
        res = train(a.steps, a.out)
    else:
        res = {"test_accuracy": accuracy(load(a.checkpoint))}
    print(json.dumps({k: v for k, v in res.items() if k != "log"}))
    return res


if __name__ == "__main__":
    main()
