"""Decoder-only configs against Hugging Face transformers models, weight for weight.

Each HF model is built from a tiny random config (no download), fp32, eager attention, eval mode. Its
parameters are jittered (norms away from 1, biases away from 0, so that each one matters), copied into the
attnlab model (every attnlab parameter is first set to NaN, so one that is not copied fails the test), and
the logits must agree: full sequence, and attnlab's KV-cache decoding against HF's full forward.

Not covered: BERT. Its embedding LayerNorm and token-type embeddings have no attnlab counterpart.
"""

import pytest
import torch
from torch import nn

from attnlab.config import ModelConfig
from attnlab.models.transformer import build_model

transformers = pytest.importorskip("transformers")

V, D, H, KV, L, FF, THETA = 128, 64, 4, 2, 2, 160, 50000.0
HD = D // H
ATOL, RTOL = 1e-5, 1e-5


def jitter(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied table is one parameter: jittered once
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def attnlab_model(**kw):
    base = dict(arch="decoder_only", vocab_size=V, d_model=D, n_heads=H, n_dec_layers=L, d_ff=FF,
                norm_position="pre", position="rope", rope_theta=THETA, scale_embeddings=False, dropout=0.0,
                max_seq_len=64)
    base.update(kw)
    model = build_model(ModelConfig(**base)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # every parameter must be overwritten from the HF model
    return model


def finish(model, hf) -> None:
    for name, p in model.named_parameters():
        assert not p.isnan().any(), f"{name} was not copied from the HF model"
    hf.eval()


# ---------------------------------------------------------------------------------------------------
# Weight mapping
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def load_llama_like(model, hf) -> None:
    """Llama and Qwen3: q/k/v_proj -> qkv_proj rows [q; k; v], gate/up_proj -> fc1 rows [gate; up]."""
    base, dec = hf.model, model.decoder
    dec.embed.weight.copy_(base.embed_tokens.weight)
    for block, layer in zip(dec.layers, base.layers, strict=True):
        a, mlp = layer.self_attn, layer.mlp
        block.self_attn.qkv_proj.weight.copy_(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
        block.self_attn.out_proj.weight.copy_(a.o_proj.weight)
        if hasattr(a, "q_norm"):
            block.self_attn.q_norm.weight.copy_(a.q_norm.weight)
            block.self_attn.k_norm.weight.copy_(a.k_norm.weight)
        block.ffn.fc1.weight.copy_(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)))
        block.ffn.fc2.weight.copy_(mlp.down_proj.weight)
        block.self_attn_norm.weight.copy_(layer.input_layernorm.weight)  # pre-norm: the norms before the sublayers
        block.ffn_norm.weight.copy_(layer.post_attention_layernorm.weight)
    dec.norm.weight.copy_(base.norm.weight)
    if model.head is not None:
        model.head.weight.copy_(hf.lm_head.weight)
    else:
        assert hf.lm_head.weight is base.embed_tokens.weight
    finish(model, hf)


@torch.no_grad()
def load_neox(model, hf) -> None:
    """GPT-NeoX: query_key_value rows are per head [q_h; k_h; v_h] (view (H, 3*hd) then chunk(3))."""
    base, dec = hf.gpt_neox, model.decoder
    dec.embed.weight.copy_(base.embed_in.weight)
    for block, layer in zip(dec.layers, base.layers, strict=True):
        a, mlp = layer.attention, layer.mlp
        w = a.query_key_value.weight.view(H, 3, HD, D).transpose(0, 1).reshape(3 * D, D)  # [q; k; v]
        b = a.query_key_value.bias.view(H, 3, HD).transpose(0, 1).reshape(3 * D)
        block.self_attn.qkv_proj.weight.copy_(w)
        block.self_attn.qkv_proj.bias.copy_(b)
        block.self_attn.out_proj.weight.copy_(a.dense.weight)
        block.self_attn.out_proj.bias.copy_(a.dense.bias)
        block.ffn.fc1.weight.copy_(mlp.dense_h_to_4h.weight)
        block.ffn.fc1.bias.copy_(mlp.dense_h_to_4h.bias)
        block.ffn.fc2.weight.copy_(mlp.dense_4h_to_h.weight)
        block.ffn.fc2.bias.copy_(mlp.dense_4h_to_h.bias)
        norms = ((block.self_attn_norm, layer.input_layernorm), (block.ffn_norm, layer.post_attention_layernorm))
        for ours, norm in norms:  # parallel pre-norm: each sublayer's norm before it
            ours.weight.copy_(norm.weight)
            ours.bias.copy_(norm.bias)
    dec.norm.weight.copy_(base.final_layer_norm.weight)
    dec.norm.bias.copy_(base.final_layer_norm.bias)
    model.head.weight.copy_(hf.lm_head.weight)
    finish(model, hf)


# ---------------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------------
def ids(B: int = 2, T: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


def check(model, hf) -> None:
    x = ids()
    with torch.no_grad():
        want = hf(input_ids=x).logits  # (B, T, V), causal, no padding
        got = model(x)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        # KV cache: a 5-token prompt, a 3-token chunk on top of the cache, then one token at a time
        cache = model.new_cache()
        steps = [model(x[:, :5], cache=cache), model(x[:, 5:8], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(8, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=ATOL, rtol=RTOL)


def hf_model(config_cls, model_cls, **kw):
    config = config_cls(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                        max_position_embeddings=64, attn_implementation="eager", **kw)
    torch.manual_seed(0)
    hf = model_cls(config).float()
    jitter(hf)
    return hf.eval()


@pytest.mark.parametrize("tie,backend", [("none", "sdpa"), ("decoder", "eager")])
def test_llama(tie, backend):
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, intermediate_size=FF,
                  num_key_value_heads=KV, rms_norm_eps=1e-6, tie_word_embeddings=tie != "none",
                  rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False,
                  mlp_bias=False)
    model = attnlab_model(n_kv_heads=KV, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", attn_bias=False,
                          ffn_bias=False, tie_embeddings=tie, attention_backend=backend)
    load_llama_like(model, hf)
    check(model, hf)


@pytest.mark.parametrize("head_dim", [HD, 24])  # 24: d_k set apart from d_model / n_heads = 16, as Qwen3 does
def test_qwen3(head_dim):
    hf = hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, intermediate_size=FF,
                  num_key_value_heads=KV, head_dim=head_dim, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False,
                  use_sliding_window=False)
    assert hf.model.layers[0].self_attn.q_proj.out_features == H * head_dim
    model = attnlab_model(n_kv_heads=KV, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", attn_bias=False,
                          ffn_bias=False, qk_norm=True, tie_embeddings="none",
                          head_dim=0 if head_dim == HD else head_dim)
    assert model.cfg.d_k == head_dim
    load_llama_like(model, hf)
    check(model, hf)


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
def test_gpt_neox(rotary_pct):
    hf = hf_model(transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, intermediate_size=4 * D,
                  hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True, attention_bias=True,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": rotary_pct})
    assert hf.gpt_neox.layers[0].attention.rotary_ndims == int(HD * rotary_pct)
    model = attnlab_model(norm="layernorm", norm_eps=1e-5, ffn="gelu", d_ff=4 * D, block="parallel",
                          attn_bias=True, ffn_bias=True, rope_fraction=rotary_pct, tie_embeddings="none")
    load_neox(model, hf)
    check(model, hf)
