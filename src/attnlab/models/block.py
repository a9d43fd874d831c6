"""ONE Transformer block. It branches on config fields; there is no class per variant.

x is the residual stream; f a sublayer: self-attention, then cross-attention (decoder blocks of an
encoder-decoder, built with cross=True, reading the encoder output `memory`), then the FFN. Each f has
three norm slots, and a norm that a placement does not use is nn.Identity:
    f_norm       before f                 (pre, sandwich)
    f_out_norm   on f's output            (sandwich)
    f_post_norm  after the residual add   (post, serial)
and a parallel post-norm block has one `post_norm` after the summed residual.

Serial (the sublayers one after the other), for each f in turn:

    x = f_post_norm(x + drop(f_out_norm(f(f_norm(x)))))

  post      x = norm(x + f(x))                      Vaswani et al. 2017, arXiv:1706.03762
  pre       x = x + f(norm(x))                      Xiong et al. 2020, arXiv:2002.04745
  sandwich  x = x + norm_out(f(norm(x)))            Ding et al. 2021 (CogView), arXiv:2105.13290

Parallel (GPT-J; GPT-NeoX; PaLM, arXiv:2204.02311): every f reads the same x and the outputs are summed,

    x = post_norm(x + drop(a) + drop(c) + drop(m)),   a, c, m = f_out_norm(f(f_norm(x))) for f = attn, cross, ffn

  post      x = norm(x + attn(x) + ffn(x))
  pre       x = x + attn(n1(x)) + ffn(n2(x))
  sandwich  x = x + n1_out(attn(n1(x))) + n2_out(ffn(n2(x)))

    serial, for each f in turn             parallel (cross-attention, when there, as a third branch)
    ┌─ x                                   ┌─ x ──────────────────┐
    │  ↓                                   │  ↓                   ↓
    │  f_norm                              │  self_attn_norm      ffn_norm
    │  ↓                                   │  ↓                   ↓
    │  f                                   │  self_attn           ffn
    │  ↓                                   │  ↓                   ↓
    │  f_out_norm                          │  self_attn_out_norm  ffn_out_norm
    │  ↓                                   │  ↓                   ↓
    │  drop                                │  drop                drop
    │  ↓                                   │  ↓                   │
    └─ +                                   └─ + ◄─────────────────┘
       ↓                                      ↓
       f_post_norm                            post_norm

Dropout is applied to each sublayer's output separately, in the order self-attention, cross-attention, FFN;
the parallel sum is x + (a + c + m), summed in that order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention, KVCache, Mask
from .layers import FeedForward, make_norm


def norm_or_identity(cfg: ModelConfig, used: bool) -> nn.Module:
    """The config's norm where a placement uses this slot; nn.Identity (no parameters, no state) where not."""
    return make_norm(cfg) if used else nn.Identity()


class Block(nn.Module):
    """Self-attention, cross-attention (cross=True) and FFN with the norms of cfg.norm_position, serial or parallel
    as cfg.block says: the formulas of the module docstring."""

    def __init__(self, cfg: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.parallel, self.cross = cfg.block == "parallel", cross
        self.self_attn = Attention(cfg)
        self.cross_attn = Attention(cfg, cross=True) if cross else None  # only decoder blocks of an encoder-decoder
        self.ffn = FeedForward(cfg)
        before, on_output, after = cfg.norm_slots  # f_norm, f_out_norm, f_post_norm (serial) or post_norm (parallel)
        self.self_attn_norm = norm_or_identity(cfg, before)
        self.self_attn_out_norm = norm_or_identity(cfg, on_output)
        self.self_attn_post_norm = norm_or_identity(cfg, after and not self.parallel)
        self.cross_attn_norm = norm_or_identity(cfg, before and cross)
        self.cross_attn_out_norm = norm_or_identity(cfg, on_output and cross)
        self.cross_attn_post_norm = norm_or_identity(cfg, after and not self.parallel and cross)
        self.ffn_norm = norm_or_identity(cfg, before)
        self.ffn_out_norm = norm_or_identity(cfg, on_output)
        self.ffn_post_norm = norm_or_identity(cfg, after and not self.parallel)
        self.post_norm = norm_or_identity(cfg, after and self.parallel)
        self.drop = nn.Dropout(cfg.dropout)

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
        # an unused slot (nn.Identity) and dropout that does nothing are not called: a module call costs ~3 us of
        # host time, ~10% of a decoding step of the demo model on a CPU (9 such calls a block)
        drop = active_dropout(self.drop)

        def attn(x: torch.Tensor) -> torch.Tensor:  # self_attn_out_norm(self_attn(self_attn_norm(x)))
            h = self.self_attn(apply_norm(self.self_attn_norm, x), self_mask, rope=rope, cache=cache, layer=layer)
            return apply_norm(self.self_attn_out_norm, h)  # (B, T, d)

        def cross(x: torch.Tensor) -> torch.Tensor:  # cross_attn_out_norm(cross_attn(cross_attn_norm(x), memory))
            h = self.cross_attn(apply_norm(self.cross_attn_norm, x), cross_mask, memory, cache=cache, layer=layer)
            return apply_norm(self.cross_attn_out_norm, h)  # (B, T, d)

        def ffn(x: torch.Tensor) -> torch.Tensor:  # ffn_out_norm(ffn(ffn_norm(x)))
            return apply_norm(self.ffn_out_norm, self.ffn(apply_norm(self.ffn_norm, x)))  # (B, T, d)

        if self.parallel:  # x = post_norm(x + drop(a) + drop(c) + drop(m)), every term reading the same x
            h = drop(attn(x))  # (B, T, d)
            if self.cross:
                h = h + drop(cross(x))  # (B, T, d)
            return apply_norm(self.post_norm, x + (h + drop(ffn(x))))  # (B, T, d)
        x = apply_norm(self.self_attn_post_norm, x + drop(attn(x)))  # (B, T, d)
        if self.cross:
            x = apply_norm(self.cross_attn_post_norm, x + drop(cross(x)))  # (B, T, d)
        return apply_norm(self.ffn_post_norm, x + drop(ffn(x)))  # (B, T, d)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def active_dropout(drop: nn.Dropout):
    """`drop`, or the identity function where it does nothing (eval mode or p = 0), which costs no module call."""
    return drop if drop.training and drop.p > 0 else _same


def apply_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x), without the module call where the slot is unused (nn.Identity)."""
    return x if type(norm) is nn.Identity else norm(x)
