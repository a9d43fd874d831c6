"""The tables the activation and norm choices are read from: name -> what it computes, with the paper that
defined it. They are the single list of those names: `attnlab.config.CHOICES["ffn"]` and `CHOICES["norm"]` are
views of these dicts, `FeedForward` and `make_norm` (layers.py) look the config's choice up here.

A leaf module: it imports only torch, never `attnlab.config`, so the config can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------------------------
# FFN activations
# ----------------------------------------------------------------------------------------------
class Activation(NamedTuple):
    """One FFN choice. Plain: fc2(fn(fc1(x))). Gated (a GLU variant): fc2(fn(x W_gate) * (x W_up)), the two
    halves fused in fc1, whose width the config then takes as 8/3 d to keep the parameters of 4d (Shazeer 2020)."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    gated: bool


ACTIVATIONS: dict[str, Activation] = {
    "relu": Activation(F.relu, gated=False),  # Vaswani et al. 2017, eq. 2
    "gelu": Activation(F.gelu, gated=False),  # Hendrycks & Gimpel 2016, arXiv:1606.08415 (exact erf, as BERT)
    # GLU variants: Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202
    "reglu": Activation(F.relu, gated=True),
    "geglu": Activation(F.gelu, gated=True),
    "swiglu": Activation(F.silu, gated=True),
}


# ----------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm, no centring and no bias (Zhang & Sennrich 2019, arXiv:1910.07467)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # statistics in fp32 even under bf16 autocast, as Llama does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        return self.weight * xf.type_as(x)


# name -> constructor (dim, eps, bias) -> module
NORMS: dict[str, Callable[[int, float, bool], nn.Module]] = {
    "layernorm": lambda dim, eps, bias: nn.LayerNorm(dim, eps=eps, bias=bias),  # Ba et al. 2016, arXiv:1607.06450
    "rmsnorm": lambda dim, eps, bias: RMSNorm(dim, eps),  # Zhang & Sennrich 2019: no bias by definition
}
