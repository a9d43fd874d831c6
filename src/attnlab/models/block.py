"""ONE Transformer block. It branches on config fields; there is no class per variant.

Norm placement (x is the residual stream, f a sublayer: self-attention, cross-attention or FFN):
  post      x = norm(x + f(x))                      Vaswani et al. 2017
  pre       x = x + f(norm(x))                      Xiong et al. 2020, arXiv:2002.04745
  sandwich  x = x + norm_out(f(norm(x)))            Ding et al. 2021 (CogView), arXiv:2105.13290
Block layout:
  serial    the sublayers one after the other
  parallel  every sublayer reads the same input and their outputs are summed
            (GPT-J; GPT-NeoX; PaLM, arXiv:2204.02311): x = x + attn(n1(x)) + ffn(n2(x)),
            and for post-norm x = norm(x + attn(x) + ffn(x)).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention, KVCache, Mask
from .layers import FeedForward, make_norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.norm_position, self.parallel = cfg.norm_position, cfg.block == "parallel"
        names = ["self_attn"] + (["cross_attn"] if cross else []) + ["ffn"]
        self.self_attn = Attention(cfg)
        self.cross_attn = Attention(cfg, cross=True) if cross else None
        self.ffn = FeedForward(cfg)
        # parallel post-norm normalises the one summed residual; everything else has a norm per sublayer
        in_names = names[:1] if (self.parallel and self.norm_position == "post") else names
        self.norms = nn.ModuleDict({n: make_norm(cfg) for n in in_names})
        self.out_norms = nn.ModuleDict({n: make_norm(cfg) for n in names}) if self.norm_position == "sandwich" else None
        self.drop = nn.Dropout(cfg.dropout)

    def _sublayer(self, name: str, x: torch.Tensor, **kw) -> torch.Tensor:
        f = self.self_attn if name == "self_attn" else self.cross_attn if name == "cross_attn" else self.ffn
        h = f(x, **kw) if name != "ffn" else f(x)
        return self.out_norms[name](h) if self.out_norms is not None else h  # (B, T, d)

    def forward(
        self,
        x: torch.Tensor,
        self_mask: Mask,
        memory: torch.Tensor | None = None,
        cross_mask: Mask | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        kwargs = {
            "self_attn": {"mask": self_mask, "rope": rope, "cache": cache, "layer": layer},
            "cross_attn": {"mask": cross_mask, "memory": memory, "cache": cache, "layer": layer},
            "ffn": {},
        }
        names = list(kwargs) if self.cross_attn is not None else ["self_attn", "ffn"]
        post = self.norm_position == "post"
        if self.parallel:
            if post:  # x = norm(x + sum f(x))
                return self.norms["self_attn"](x + sum(self.drop(self._sublayer(n, x, **kwargs[n])) for n in names))
            return x + sum(self.drop(self._sublayer(n, self.norms[n](x), **kwargs[n])) for n in names)
        for n in names:
            if post:
                x = self.norms[n](x + self.drop(self._sublayer(n, x, **kwargs[n])))  # (B, T, d)
            else:
                x = x + self.drop(self._sublayer(n, self.norms[n](x), **kwargs[n]))  # (B, T, d)
        return x
