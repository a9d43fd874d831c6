"""The encoder-decoder against torch.nn.Transformer, weight for weight.

The reference is nn.Transformer (batch_first, dropout 0) with its own embeddings, the paper's sinusoidal
positions (computed here from the formula, in float64), the sqrt(d) embedding scale and an output layer.
attnlab's weights are jittered first (biases and norms away from 0 and 1, so a wrongly mapped bias or
norm shows up) and copied into the reference; logits must agree in fp32.
"""

import math

import pytest
import torch
from torch import nn

from attnlab.config import ModelConfig
from attnlab.models.transformer import build_model
from conftest import jitter

V, V_SRC, D, H, FF, N = 53, 47, 32, 4, 64, 2
ATOL, RTOL = 1e-5, 1e-5


def paper_positions(T: int, d: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (section 3.5)."""
    pos = torch.arange(T, dtype=torch.float64)[:, None]  # (T, 1)
    two_i = torch.arange(0, d, 2, dtype=torch.float64)[None, :]  # (1, d/2)
    angle = pos / 10000.0 ** (two_i / d)  # (T, d/2)
    pe = torch.zeros(T, d, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = angle.sin(), angle.cos()
    return pe.float()


class TorchReference(nn.Module):
    """Embeddings * sqrt(d) + PE -> nn.Transformer -> linear output layer."""

    def __init__(self, src_vocab: int, norm_first: bool, activation: str) -> None:
        super().__init__()
        kw = dict(d_model=D, nhead=H, dim_feedforward=FF, dropout=0.0, activation=activation, batch_first=True,
                  norm_first=norm_first, layer_norm_eps=1e-5)
        # post-norm: no final stack norm (as attnlab); pre-norm: a final LayerNorm per stack (as attnlab)
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), N,
                                        norm=nn.LayerNorm(D) if norm_first else None, enable_nested_tensor=False)
        decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**kw), N,
                                        norm=nn.LayerNorm(D) if norm_first else None)
        self.transformer = nn.Transformer(d_model=D, nhead=H, custom_encoder=encoder, custom_decoder=decoder,
                                          batch_first=True)
        self.src_embed = nn.Embedding(src_vocab, D)
        self.tgt_embed = nn.Embedding(V, D)
        self.out = nn.Linear(D, V, bias=False)

    def embed(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return table(ids) * math.sqrt(D) + paper_positions(ids.shape[1], D)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        src_pad = src.eq(pad_id)  # (B, S) True at padding
        tgt_mask = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = hidden
        x_src, x_tgt = self.embed(self.src_embed, src), self.embed(self.tgt_embed, tgt)
        h = self.transformer(x_src, x_tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad,
                             memory_key_padding_mask=src_pad)  # (B, T, d)
        memory = self.transformer.encoder(x_src, src_key_padding_mask=src_pad)  # (B, S, d), to compare too
        return self.out(h), memory


def copy_attention(mha: nn.MultiheadAttention, attn, cross: bool) -> None:
    if cross:  # in_proj rows [q; k; v] -> q_proj, kv_proj ([k; v])
        mha.in_proj_weight.copy_(torch.cat((attn.q_proj.weight, attn.kv_proj.weight)))
        mha.in_proj_bias.copy_(torch.cat((attn.q_proj.bias, attn.kv_proj.bias)))
    else:  # qkv_proj rows are [q; k; v] like in_proj
        mha.in_proj_weight.copy_(attn.qkv_proj.weight)
        mha.in_proj_bias.copy_(attn.qkv_proj.bias)
    mha.out_proj.weight.copy_(attn.out_proj.weight)
    mha.out_proj.bias.copy_(attn.out_proj.bias)


def copy_norm(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


def copy_ffn(layer, ffn) -> None:
    layer.linear1.weight.copy_(ffn.fc1.weight)
    layer.linear1.bias.copy_(ffn.fc1.bias)
    layer.linear2.weight.copy_(ffn.fc2.weight)
    layer.linear2.bias.copy_(ffn.fc2.bias)


def block_norms(block, pre: bool) -> tuple:
    """attnlab's counterparts of nn.Transformer's norm1, norm2 (, norm3): the norms before the sublayers
    (norm_first) or after each residual add (post-norm). Cross-attention ones are nn.Identity in an encoder."""
    if pre:
        return block.self_attn_norm, block.cross_attn_norm, block.ffn_norm
    return block.self_attn_post_norm, block.cross_attn_post_norm, block.ffn_post_norm


@torch.no_grad()
def load_into_reference(model, ref: TorchReference) -> None:
    pre = model.cfg.norm_position == "pre"
    for layer, block in zip(ref.transformer.encoder.layers, model.encoder.layers, strict=True):
        copy_attention(layer.self_attn, block.self_attn, cross=False)
        copy_ffn(layer, block.ffn)
        self_norm, _, ffn_norm = block_norms(block, pre)
        copy_norm(layer.norm1, self_norm)
        copy_norm(layer.norm2, ffn_norm)
    for layer, block in zip(ref.transformer.decoder.layers, model.decoder.layers, strict=True):
        copy_attention(layer.self_attn, block.self_attn, cross=False)
        copy_attention(layer.multihead_attn, block.cross_attn, cross=True)
        copy_ffn(layer, block.ffn)
        self_norm, cross_norm, ffn_norm = block_norms(block, pre)
        copy_norm(layer.norm1, self_norm)
        copy_norm(layer.norm2, cross_norm)
        copy_norm(layer.norm3, ffn_norm)
    if ref.transformer.encoder.norm is not None:
        copy_norm(ref.transformer.encoder.norm, model.encoder.norm)
        copy_norm(ref.transformer.decoder.norm, model.decoder.norm)
    ref.src_embed.weight.copy_(model.encoder.embed.weight)
    ref.tgt_embed.weight.copy_(model.decoder.embed.weight)
    ref.out.weight.copy_(model.head.weight if model.head is not None else model.decoder.embed.weight)


def batch(src_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(1, src_vocab, (3, 9), generator=g)
    src[1, 6:] = 0  # real padding: rows of different lengths
    src[2, 4:] = 0
    tgt = torch.randint(1, V, (3, 7), generator=g)
    return src, tgt


CASES = [  # norm_position, ffn, tie_embeddings
    ("post", "relu", "all"),  # the paper's base model
    ("post", "relu", "none"),  # separate source vocabulary and output layer
    ("pre", "relu", "decoder"),
    ("post", "gelu", "all"),
    ("pre", "gelu", "none"),
]


def build_pair(norm_position: str, ffn: str, tie: str, backend: str = "sdpa"):
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=V, src_vocab_size=V if tie == "all" else V_SRC, d_model=D,
                      n_heads=H, n_enc_layers=N, n_dec_layers=N, d_ff=FF, norm="layernorm",
                      norm_position=norm_position, ffn=ffn, position="sinusoidal", tie_embeddings=tie,
                      scale_embeddings=True, dropout=0.0, attention_backend=backend, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    jitter(model)
    ref = TorchReference(cfg.source_vocab_size, norm_first=norm_position == "pre", activation=ffn).eval()
    load_into_reference(model, ref)
    return cfg, model, ref


@pytest.mark.parametrize("norm_position,ffn,tie", CASES)
def test_matches_nn_transformer(norm_position, ffn, tie):
    cfg, model, ref = build_pair(norm_position, ffn, tie)
    src, tgt = batch(cfg.source_vocab_size)
    with torch.no_grad():
        want, want_memory = ref(src, tgt)
        memory, src_pad = model.encode(src)
        got = model(src, tgt)
    keep = ~src_pad  # compare the encoder output on real tokens only
    torch.testing.assert_close(memory[keep], want_memory[keep], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_cached_decoding_matches_nn_transformer(norm_position):
    cfg, model, ref = build_pair(norm_position, "relu", "all", backend="eager")
    src, tgt = batch(cfg.source_vocab_size)
    with torch.no_grad():
        want, _ = ref(src, tgt)
        memory, src_pad = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, :3], memory, src_pad, cache=cache)]  # a 3-token prefix, then one at a time
        steps += [model.decode(tgt[:, t : t + 1], memory, src_pad, cache=cache) for t in range(3, tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=ATOL, rtol=RTOL)
