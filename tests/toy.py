"""A small plain-PyTorch transformer encoder used by the core tests."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, kpm=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=kpm)[0]
        return x + self.mlp(self.norm2(x))


class ToyEncoder(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 6, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, 5)
        with torch.no_grad():  # every parameter from the seeded generator: no global RNG
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
                elif "norm" in name and name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))

    def forward(self, x, kpm=None):
        for layer in self.layers:
            x = layer(x, kpm)
        return self.head(x)


def toy_batches(n: int = 6, b: int = 2, tokens: int = 48, dim: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    # A smooth token sequence with structure, so attention is not uniform.
    base = torch.randn(n, b, 1, dim, generator=g)
    pos = torch.linspace(0, 3, tokens).view(1, 1, tokens, 1)
    return list(base * torch.cos(pos * torch.arange(dim).view(1, 1, 1, dim) / 4) + 0.3 * torch.randn(n, b, tokens, dim, generator=g))
