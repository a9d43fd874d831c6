"""EncoderDecoder, DecoderOnly and Encoder, built from one ModelConfig. Plain PyTorch: no Lightning, no I/O."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import KVCache, Mask, causal_allowed
from .block import Block, active_dropout, apply_norm, norm_or_identity
from .layers import AbsolutePositions, PositionTable, alibi_bias, alibi_slopes, make_norm, rope_cos_sin


def check_ids(ids: torch.Tensor, vocab: int, what: str, field: str = "model.vocab_size") -> None:
    """Token ids outside the table are a clear error here, not an index error deep inside a kernel."""
    if ids.dim() != 2:
        raise ValueError(f"{what} token ids must have shape (batch, length), got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what} token ids must be int64 or int32, got {ids.dtype}")
    if ids.numel() and not torch.compiler.is_compiling():
        message = f"{what} token id outside the vocabulary [0, {vocab}) ({field})"
        try:  # no host sync: a CPU raises here at once, a GPU raises on its next sync (a device-side assert)
            torch._assert_async(((ids >= 0) & (ids < vocab)).all(), message)
        except RuntimeError:  # on a CPU only: read the ids to name the bad one
            lo, hi = int(ids.min()), int(ids.max())
            bad = lo if lo < 0 else hi
            raise ValueError(message.replace("token id", f"token id {bad} is", 1)) from None


class Stack(nn.Module):
    """Token embedding (+ absolute positions) (-> embed_norm) -> N blocks -> final norm (pre/sandwich only)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding, n_layers: int, causal: bool, cross: bool) -> None:
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.embed = embed
        self.positions = AbsolutePositions(cfg) if cfg.position in ("sinusoidal", "learned") else None
        rope = functools.partial(rope_cos_sin, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
        self.rope = PositionTable(rope, cfg.max_seq_len) if cfg.position == "rope" else None  # (T, r) cos, sin
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        # a norm of the embeddings before the first block (BERT, Devlin et al. 2019; BLOOM, arXiv:2211.05100)
        self.embed_norm = norm_or_identity(cfg, cfg.embed_norm)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, cross=cross) for _ in range(n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else None
        if cfg.position == "alibi":
            self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def _self_mask(self, Tq: int, Tk: int, start: int, key_pad: torch.Tensor | None, device) -> Mask:
        """Self-attention of Tq new queries (positions start..start+Tq) over Tk keys (0..Tk)."""
        causal = self.causal and Tq > 1  # one new query after a cached prefix may see every key
        if self.cfg.position != "alibi":  # no mask tensor for plain causal attention: the kernel applies it
            allowed = ~key_pad[:, None, None, :] if key_pad is not None else None  # (B, 1, 1, Tk)
            return Mask(causal=causal, bias=allowed, key_pad=key_pad)
        q_pos = torch.arange(start, start + Tq, device=device)  # (Tq,)
        bias = alibi_bias(self.slopes, q_pos, torch.arange(Tk, device=device))  # (H, Tq, Tk)
        if causal:
            bias = bias.masked_fill(~causal_allowed(Tq, Tk, device), float("-inf"))  # (H, Tq, Tk)
        if key_pad is not None:  # encoder: hide padded keys
            bias = bias.masked_fill(key_pad[:, None, None, :], float("-inf"))  # (B, H, Tq, Tk)
        return Mask(bias=bias, key_pad=key_pad)

    def forward(
        self,
        ids: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_pad: torch.Tensor | None = None,
        cache: KVCache | None = None,
        padded: bool = True,
    ) -> torch.Tensor:
        """`padded=False`: the caller knows (on the host) that `ids` hold no padding, so an encoder builds no mask
        and SDPA may take its flash kernel; a causal stack never masks padded keys (they follow the real ones)."""
        T = ids.shape[1]
        start = cache.pos if cache is not None else 0  # an int, or a 0-d device tensor (StaticKVCache)
        x = self.embed(ids) * self.embed_scale  # (B, T, d)
        if self.positions is not None:  # in the activations' dtype: fp32 positions would promote bf16 weights' x
            pos = self.positions(start, T, ids.device)  # (T, d)
            x = x + (pos if pos.dtype == x.dtype else pos.to(x.dtype))  # (B, T, d) + (T, d)
        x = active_dropout(self.drop)(apply_norm(self.embed_norm, x))  # (B, T, d)
        key_pad = ids.eq(self.cfg.pad_id) if padded and not self.causal else None  # (B, T) True at padding
        mask = self._self_mask(T, start + T, start, key_pad, ids.device)
        if memory_pad is None:
            cross_mask = Mask()
        elif cache is not None:  # the same padding at every step of a search: its mask is made once
            cross_mask = cache.source_mask(memory_pad)
        else:
            cross_mask = Mask(bias=~memory_pad[:, None, None, :], key_pad=memory_pad)  # (B, 1, 1, S)
        rope = self.rope(start, T, ids.device) if self.rope is not None else None  # (T, r) cos and sin
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, memory=memory, cross_mask=cross_mask, rope=rope, cache=cache, layer=i)  # (B, T, d)
        if cache is not None:
            cache.pos += T
        return self.norm(x) if self.norm is not None else x  # (B, T, d)


class _Model(nn.Module):
    """Shared parts: the stacks (registered in the order given), the output head (tied to the last stack's
    embedding unless tie_embeddings=none), logit soft-capping, initialisation."""

    def __init__(self, cfg: ModelConfig, **stacks: Stack) -> None:
        super().__init__()
        self.cfg = cfg
        for name, stack in stacks.items():
            self.add_module(name, stack)
        self._last_stack = list(stacks)[-1]  # a name, not a module: the last stack, decided once
        tie = cfg.tie_embeddings != "none"
        self.head = None if tie else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def _stack(self) -> Stack:
        """The last stack: `decoder` where there is one, else `encoder`."""
        return getattr(self, self._last_stack)

    def output_embedding(self) -> nn.Embedding:
        """The table the head shares when tied: the embedding of the last stack."""
        return self._stack().embed

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Project hidden states to the vocabulary; soft-cap when configured (Gemma 2, arXiv:2408.00118)."""
        out = self.head(h) if self.head is not None else F.linear(h, self.output_embedding().weight)  # (B, T, V)
        if self.cfg.logit_softcap:
            out = self.cfg.logit_softcap * torch.tanh(out / self.cfg.logit_softcap)
        return out

    def reset_parameters(self) -> None:
        """xavier: Xavier-uniform per projection, N(0, d^-1/2) embeddings (fairseq's Transformer).
        normal: N(0, init_std), residual output projections scaled by 1/sqrt(2 * layers) (GPT-2)."""
        cfg = self.cfg
        n_layers = cfg.n_enc_layers * (cfg.arch != "decoder_only") + cfg.n_dec_layers * (cfg.arch != "encoder_only")
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if cfg.init == "xavier":
                    # a fused projection is initialised as its separate parts would be
                    if name.endswith("qkv_proj"):
                        parts = [cfg.n_heads * cfg.d_k, cfg.kv_heads * cfg.d_k, cfg.kv_heads * cfg.d_v]
                    elif name.endswith("kv_proj"):
                        parts = [cfg.kv_heads * cfg.d_k, cfg.kv_heads * cfg.d_v]
                    elif name.endswith("fc1") and cfg.gated:
                        parts = [cfg.ffn_dim] * 2
                    else:
                        parts = [m.weight.shape[0]]
                    for w in m.weight.data.split(parts, dim=0):
                        nn.init.xavier_uniform_(w)
                else:
                    std = cfg.init_std
                    if name.endswith(("out_proj", "fc2")):
                        std = std / math.sqrt(2 * n_layers)
                    nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                std = cfg.d_model**-0.5 if cfg.init == "xavier" else cfg.init_std
                nn.init.normal_(m.weight, 0.0, std)


class EncoderDecoder(_Model):
    """The Transformer of Vaswani et al. 2017 (arXiv:1706.03762) and its variants."""

    def __init__(self, cfg: ModelConfig) -> None:
        tgt_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        shared = cfg.tie_embeddings == "all"  # one table for source, target and output (Press & Wolf 2017)
        src_embed = tgt_embed if shared else nn.Embedding(cfg.source_vocab_size, cfg.d_model)
        super().__init__(cfg, encoder=Stack(cfg, src_embed, cfg.n_enc_layers, causal=False, cross=False),
                         decoder=Stack(cfg, tgt_embed, cfg.n_dec_layers, causal=True, cross=True))

    def encode(self, src: torch.Tensor, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """src (B, S) padded with pad_id -> memory (B, S, d), src_pad (B, S) True at padding. `padded=False` (the
        batch is known to hold no padding): src_pad is None, and neither the encoder nor the cross-attention gets
        a mask."""
        check_ids(src, self.cfg.source_vocab_size, "source",
                  "model.src_vocab_size" if self.cfg.src_vocab_size else "model.vocab_size")
        return self.encoder(src, padded=padded), src.eq(self.cfg.pad_id) if padded else None

    def decode(
        self, tgt: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor | None, cache: KVCache | None = None,
        return_hidden: bool = False, check: bool = True,
    ) -> torch.Tensor:
        """tgt (B, T): the whole target prefix, or with a cache only the new tokens -> logits (B, T, V). `check=False`
        skips the check of the ids against the vocabulary (five operators): for a search's own ids, which come from
        the vocabulary's logits."""
        if check:
            check_ids(tgt, self.cfg.vocab_size, "target")
        h = self.decoder(tgt, memory=memory, memory_pad=src_pad, cache=cache)  # (B, T, d)
        return h if return_hidden else self.logits(h)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, return_hidden: bool = False,
                src_padded: bool = True) -> torch.Tensor:
        memory, src_pad = self.encode(src, padded=src_padded)  # (B, S, d), (B, S) or None
        return self.decode(tgt, memory, src_pad, return_hidden=return_hidden)  # (B, T, V)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.n_dec_layers)

    def cache_cross_attention(self, memory: torch.Tensor, cache: KVCache) -> None:
        """Fill the cache's cross-attention keys/values from memory (B, S, d), one row per sentence: decoding
        B*g rows (g beams a sentence) over it, each sentence's g rows of queries attend to its one row."""
        for i, block in enumerate(self.decoder.layers):
            # contiguous (B, Hkv, S, hd) once, not transposed views that every step's attention reads across
            cache.cross_kv[i] = tuple(t.contiguous() for t in block.cross_attn.memory_kv(memory))  # (B, Hkv, S, hd)


class _OneStack(_Model):
    """One stack of blocks over a token embedding, and the vocabulary head: `decoder` (causal) or `encoder`."""

    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        n_layers = cfg.n_dec_layers if causal else cfg.n_enc_layers
        stack = Stack(cfg, nn.Embedding(cfg.vocab_size, cfg.d_model), n_layers, causal=causal, cross=False)
        super().__init__(cfg, **{"decoder" if causal else "encoder": stack})

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, return_hidden: bool = False,
                padded: bool = True, check: bool = True) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V) (or hidden states (B, T, d)). With a cache (causal only), ids are the new
        tokens after cache.pos; an encoder's ids may be padded with pad_id (`padded=False`: known to hold none).
        `check=False` skips the check of the ids against the vocabulary: for ids sampled from the model's logits."""
        if check:
            check_ids(ids, self.cfg.vocab_size, "input")
        stack = self._stack()  # the only one
        if cache is not None and not stack.causal:
            raise ValueError("a KV cache is for causal decoding; an encoder attends both ways")
        h = stack(ids, cache=cache, padded=padded)  # (B, T, d)
        return h if return_hidden else self.logits(h)


class DecoderOnly(_OneStack):
    """A causal language model (GPT: Radford et al. 2018; Llama: Touvron et al. 2023)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, causal=True)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.n_dec_layers)


class Encoder(_OneStack):
    """A bidirectional encoder with a vocabulary head (BERT-style, Devlin et al. 2019)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, causal=False)


def build_model(cfg: ModelConfig) -> EncoderDecoder | DecoderOnly | Encoder:
    return {"encoder_decoder": EncoderDecoder, "decoder_only": DecoderOnly, "encoder_only": Encoder}[cfg.arch](cfg)
