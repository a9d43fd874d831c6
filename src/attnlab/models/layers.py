"""Norms, feed-forward networks and position encodings. Each variant cites where it was defined (the
activations and norms in tables.py, the table their names are read from)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from .tables import ACTIVATIONS, NORMS


# ----------------------------------------------------------------------------------------------
# Norms and feed-forward: the choices are the names in tables.py
# ----------------------------------------------------------------------------------------------
def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm `cfg.norm` names in `tables.NORMS` (LayerNorm or RMSNorm), over `dim` (default d_model)."""
    return NORMS[cfg.norm](dim or cfg.d_model, cfg.norm_eps, cfg.norm_bias)


class FeedForward(nn.Module):
    """Position-wise FFN: fc2(act(fc1(x))), or for a gated choice fc2(act(x W_gate) * (x W_up)), W_gate and W_up
    fused in fc1. `act` and whether it is gated come from `tables.ACTIVATIONS[cfg.ffn]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act, self.gated = ACTIVATIONS[cfg.ffn]
        hidden = cfg.ffn_dim
        self.fc1 = nn.Linear(cfg.d_model, hidden * (2 if self.gated else 1), bias=cfg.ffn_bias)
        self.fc2 = nn.Linear(hidden, cfg.d_model, bias=cfg.ffn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, T, ff) or (B, T, 2*ff) when gated
        if self.gated:
            gate, up = h.chunk(2, dim=-1)  # (B, T, ff) each
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.fc2(h)  # (B, T, d)


# ----------------------------------------------------------------------------------------------
# Absolute positions (added to embeddings)
# ----------------------------------------------------------------------------------------------
def sinusoidal_positions(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (Vaswani et al. 2017, section 3.5).

    Sines and cosines are interleaved as in the paper's formula. Any length works (AbsolutePositions keeps the rows it
    has used in a PositionTable, and computes past max_seq_len).
    """
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )  # (d/2,)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, d/2)
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (T, d/2, 2)
    return pe.flatten(-2)  # (T, d)


class PositionTable:
    """fn(positions) kept for positions 0 .. n-1 on one device, n a power of two grown on demand up to `limit`: a
    decoding step slices rows instead of recomputing (fn is elementwise in the positions, so the rows are the values
    fn gives them alone). fn: (n,) positions -> a tensor or a tuple of tensors with n rows; a picklable function (a
    module holding the table may be pickled: spawned processes). Not module state."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]], limit: int) -> None:
        self.fn, self.limit = fn, limit
        self.rows: tuple[torch.Tensor, ...] | None = None
        self.single = True

    def __call__(self, start: int | torch.Tensor, length: int, device: torch.device) -> Any:
        """fn(start .. start + length - 1); from the table where `start` is an int and the end within `limit`, else
        computed (a 0-d device tensor `start`: a StaticKVCache's, whose step must not depend on the host)."""
        end = start + length
        if not isinstance(start, int) or end > self.limit:
            return self.fn(torch.arange(length, device=device) + start)
        if self.rows is None or self.rows[0].device != torch.device(device) or len(self.rows[0]) < end:
            n = min(self.limit, 1 << max(end - 1, 1).bit_length())  # a power of two >= end
            out = self.fn(torch.arange(n, device=device))
            self.single = isinstance(out, torch.Tensor)
            self.rows = (out,) if self.single else tuple(out)
        parts = tuple(t[start:end] for t in self.rows)  # (T, ...) each
        return parts[0] if self.single else parts


class AbsolutePositions(nn.Module):
    """Sinusoidal or learned absolute positions, added to the (scaled) token embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.position
        self.max_len = cfg.max_seq_len
        if self.kind == "learned":  # Gehring et al. 2017 (ConvS2S); Vaswani et al. 2017 Table 3 row (E)
            self.table = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        else:  # sinusoidal: a table of the positions used so far (a decoding step slices a row instead of running
            # arange, exp, sin, cos and stack)
            self.sines = PositionTable(functools.partial(sinusoidal_positions, dim=cfg.d_model), cfg.max_seq_len)

    def forward(self, start: int | torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
        """Positions start .. start + length - 1; `start` may be a 0-d device tensor (a StaticKVCache's)."""
        if self.kind == "learned" and isinstance(start, int) and start + length > self.max_len:
            raise ValueError(
                f"sequence of {start + length} positions is longer than the learned position table "
                f"(model.max_seq_len={self.max_len}); raise max_seq_len or truncate the input"
            )
        if self.kind == "sinusoidal":
            return self.sines(start, length, device)  # (T, d)
        return self.table(torch.arange(length, device=device) + start)  # (T, d)


# ----------------------------------------------------------------------------------------------
# Relative positions inside attention
# ----------------------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables (Su et al. 2021, RoFormer, arXiv:2104.09864), rotate-half layout (GPT-NeoX, Llama)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim)
    )  # (r/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, r/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, r)
    return emb.cos(), emb.sin()  # fp32 tables; apply_rope casts them to the activations' dtype


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `r` dims of each head; the rest pass through (partial rotary, GPT-NeoX rotary_pct)."""
    r = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]  # (B, H, T, r), (B, H, T, hd-r)
    x1, x2 = x_rot.chunk(2, dim=-1)  # (B, H, T, r/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, H, T, r)
    out = x_rot * cos + rotated * sin  # cos/sin: (T, r) broadcast over (B, H)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes of ALiBi (Press et al. 2022, arXiv:2108.12409): geometric 2^(-8/n), 2^(-16/n), ...

    For a head count that is not a power of two, the paper takes the slopes of the closest smaller
    power of two and adds every other slope of twice that many heads.
    """

    def pow2_slopes(n: int) -> list[float]:
        start = 2 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = pow2_slopes(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = pow2_slopes(closest) + pow2_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)  # (H,)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bias -m * |i - j| added to scores; symmetric, so it also serves a bidirectional encoder."""
    dist = (q_pos[:, None] - k_pos[None, :]).abs().float()  # (Tq, Tk)
    return -slopes[:, None, None] * dist[None]  # (H, Tq, Tk)
