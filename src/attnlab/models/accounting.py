"""Exact parameter counts and training FLOPs from a ModelConfig alone: no model is built.

`count_parameters(cfg)["total"]` equals `sum(p.numel() for p in build_model(cfg).parameters())` for
every variant (tests check the whole grid), so a billion-parameter config is sized instantly.

Training FLOPs follow Kaplan et al. 2020 (arXiv:2001.08361) and PaLM (arXiv:2204.02311, appendix B):
6 FLOPs per parameter per token for every matmul weight (2 forward + 4 backward), plus the attention
score and value products, 6 * n_heads * (d_k + d_v) * (key length) per query token per layer
(12 * d_attn when d_k = d_v). As in PaLM the causal
mask is not credited (the kernels skip about half of it; MFU figures stay comparable with PaLM's).
Embedding lookups cost no FLOPs; the output projection counts even when tied to the embedding.
"""

from __future__ import annotations

from ..config import ModelConfig


def norm_params(cfg: ModelConfig, dim: int | None = None) -> int:
    dim = dim or cfg.d_model
    return dim * (2 if cfg.norm == "layernorm" and cfg.norm_bias else 1)


def linear_params(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention_params(cfg: ModelConfig, cross: bool = False) -> dict[str, int]:
    d, q_dim, kv_dim = cfg.d_model, cfg.n_heads * cfg.d_k, cfg.kv_heads * (cfg.d_k + cfg.d_v)
    if cross:
        proj = {"q": linear_params(d, q_dim, cfg.attn_bias), "kv": linear_params(d, kv_dim, cfg.attn_bias)}
    else:
        proj = {"qkv": linear_params(d, q_dim + kv_dim, cfg.attn_bias)}
    proj["out"] = linear_params(cfg.n_heads * cfg.d_v, d, cfg.attn_bias)
    proj["qk_norm"] = 2 * norm_params(cfg, cfg.d_k) if cfg.qk_norm else 0
    return proj


def ffn_params(cfg: ModelConfig) -> int:
    ff = cfg.ffn_dim
    fc1 = linear_params(cfg.d_model, ff * (2 if cfg.gated else 1), cfg.ffn_bias)
    return fc1 + linear_params(ff, cfg.d_model, cfg.ffn_bias)


def block_params(cfg: ModelConfig, cross: bool = False) -> dict[str, int]:
    """One Block: its attention(s), FFN and norms, counted as block.py makes them (the others are nn.Identity)."""
    n_sub = 3 if cross else 2  # self-attention, (cross-attention), FFN
    parallel = cfg.block == "parallel"
    before, on_output, after = cfg.norm_slots  # f_norm, f_out_norm, f_post_norm (serial) or post_norm (parallel)
    n_norms = n_sub * before + n_sub * on_output + (1 if parallel else n_sub) * after
    out = {"self_attention": sum(attention_params(cfg).values())}
    if cross:
        out["cross_attention"] = sum(attention_params(cfg, cross=True).values())
    out["ffn"] = ffn_params(cfg)
    out["norms"] = n_norms * norm_params(cfg)
    return out


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by component, and their 'total'. Shared tables are counted once."""
    d = cfg.d_model
    out: dict[str, int] = {}
    stacks = {
        "encoder_decoder": [("encoder", cfg.n_enc_layers, False), ("decoder", cfg.n_dec_layers, True)],
        "decoder_only": [("decoder", cfg.n_dec_layers, False)],
        "encoder_only": [("encoder", cfg.n_enc_layers, False)],
    }[cfg.arch]
    if cfg.arch == "encoder_decoder" and cfg.tie_embeddings != "all":
        out["embeddings"] = (cfg.source_vocab_size + cfg.vocab_size) * d
    else:
        out["embeddings"] = cfg.vocab_size * d
    for name, n_layers, cross in stacks:
        if cfg.position == "learned":
            out[f"{name}.positions"] = cfg.max_seq_len * d
        if cfg.embed_norm:
            out[f"{name}.embed_norm"] = norm_params(cfg)
        for part, n in block_params(cfg, cross).items():
            out[f"{name}.{part}"] = n_layers * n
        if cfg.final_norm:
            out[f"{name}.norms"] += norm_params(cfg)
    out["head"] = 0 if cfg.tie_embeddings != "none" else d * cfg.vocab_size
    out["total"] = sum(out.values())
    return out


def layer_parameters(cfg: ModelConfig, cross: bool = False) -> int:
    """Parameters of one block, e.g. a BERT-base encoder layer = 7,087,872."""
    return sum(block_params(cfg, cross).values())


def training_flops(cfg: ModelConfig, seq_len: int, src_len: int | None = None) -> dict[str, float]:
    """Training FLOPs (forward + backward) for ONE sequence (decoder-only, encoder-only) or ONE pair
    (encoder-decoder: `src_len` source tokens, `seq_len` target tokens), by component, plus 'total' and
    'per_token' (per target token for encoder-decoder, per token otherwise)."""
    qkv = cfg.n_heads * (cfg.d_k + cfg.d_v)  # q.k over d_k and weights.v over d_v, per key, all heads
    T = seq_len
    S = src_len if src_len is not None else seq_len
    out: dict[str, float] = {}

    def stack(name: str, n_layers: int, tokens: int, cross: bool) -> None:
        blk = block_params(cfg, cross)
        dense = n_layers * (blk["self_attention"] + blk["ffn"] + blk["norms"])
        dense += norm_params(cfg) * (cfg.final_norm + cfg.embed_norm)
        out[f"{name}.dense"] = 6.0 * dense * tokens
        out[f"{name}.attention"] = 6.0 * n_layers * qkv * tokens * tokens
        if cross:
            cross_p = attention_params(cfg, cross=True)
            # K/V projections read the source tokens; Q and output projections the target tokens
            per_target = cross_p["q"] + cross_p["out"] + cross_p["qk_norm"]
            out[f"{name}.cross_dense"] = 6.0 * n_layers * (cross_p["kv"] * S + per_target * tokens)
            out[f"{name}.cross_attention"] = 6.0 * n_layers * qkv * tokens * S

    if cfg.arch == "encoder_decoder":
        stack("encoder", cfg.n_enc_layers, S, cross=False)
        stack("decoder", cfg.n_dec_layers, T, cross=True)
    elif cfg.arch == "decoder_only":
        stack("decoder", cfg.n_dec_layers, T, cross=False)
    else:
        stack("encoder", cfg.n_enc_layers, T, cross=False)
    out["head"] = 6.0 * cfg.d_model * cfg.vocab_size * T
    out["total"] = sum(out.values())
    out["per_token"] = out["total"] / T
    return out


def flops_per_token(cfg: ModelConfig, seq_len: int, src_len: int | None = None) -> float:
    return training_flops(cfg, seq_len, src_len)["per_token"]
