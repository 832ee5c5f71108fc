import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def qkv(b=2, h=4, n=37, m=None, d=16, dv=None, dtype=torch.float32, scale=1.0):
    m = n if m is None else m
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(b, h, n, d, generator=g) * scale
    k = torch.randn(b, h, m, d, generator=g) * scale
    v = torch.randn(b, h, m, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)
