"""attnlab against Hugging Face transformers models, weight for weight.

Each HF model is built from a tiny random config (no download), fp32, eager attention, eval mode. Its parameters
are jittered (conftest.jitter: norms away from 1, biases away from 0, so that each one matters), then copied into
the attnlab model, every parameter of which is first set to NaN, so that one not copied fails the test. Where the
layouts differ the copy maps them, and each `load_*` function says how. The checks, on a right-padded batch of
sequences up to 16 tokens (3 rows of different lengths):
  - logits in fp32 (atol = rtol = 1e-5) at every real position, HF given the attention mask;
  - decoder-only: attnlab's KV-cache decoding (a prompt, a chunk, then one token at a time) gives the same logits,
    and greedy generation over the cache (`attnlab.decode.generate`, the rows of different lengths in one call)
    gives the tokens of HF's `generate` for each prompt;
  - Marian: greedy search and beam search (beam 4, fairseq's length penalty len^alpha, n-best lists and their
    scores) give HF's `generate` on a padded batch of sources, EOS and the maximum length matched.

Which test proves which variant (the config table of docs/variants.md names them too):

    arch               encoder_decoder: test_marian (and tests/test_parity_torch.py); decoder_only: every test
                       with a CausalLM; encoder_only: test_bert
    n_kv_heads         MHA test_gpt2, test_bloom; GQA test_llama, test_gemma2; MQA test_llama[mqa], test_falcon
    norm               layernorm test_bert, test_bloom, test_gpt2; rmsnorm test_llama, test_gemma2
    norm_position      post test_bert, test_marian; pre test_llama, test_gpt2; sandwich test_gemma2
    ffn                relu test_marian; gelu test_bert, test_gpt2, test_falcon; geglu test_gemma2; swiglu test_llama
    block              serial: most; parallel test_gpt_neox (two norms), test_falcon (one shared norm, MQA)
    qk_norm            test_qwen3
    position           sinusoidal test_marian; learned test_gpt2, test_bert; rope test_llama, test_gpt_neox
                       (rope_fraction); alibi test_bloom
    tie_embeddings     none test_llama; decoder test_gemma2, test_gpt2; all test_marian
    scale_embeddings   test_gemma2, test_marian
    embed_norm         test_bloom, test_bert
    softcaps           attn_softcap and logit_softcap test_gemma2

Variants no HF model implements, and the two tests that together cover them (the norm is a module the block calls
in its slots; the block does not know which norm it holds):
    post-norm RMSNorm      test_bert (post-norm slots) + test_llama (RMSNorm); test_post_norm_rmsnorm also runs
                           HF's BERT layers with HF's own Llama RMSNorm put in their norm slots
    sandwich LayerNorm     test_gemma2 (sandwich slots) + test_gpt2 (LayerNorm with bias)
    qk_norm LayerNorm      test_qwen3 (per-head q/k norms) + test_gpt_neox (LayerNorm)
    parallel post-norm     test_gpt_neox (parallel sum) + test_bert (post-norm); one post_norm after the sum
    reglu                  test_llama (gated fc1 [gate; up] wiring) + tests/test_layers.py (the ReLU formula)
    alibi in an encoder    test_bloom (slopes, causal) + tests/test_layers.py (the symmetric bias -m|i-j|)
HF's own shortcuts the copies work around are named where they happen (BLOOM's tanh GELU, Gemma 2's sliding window).
"""

import math

import pytest
import torch
import transformers
from torch import nn

from attnlab.config import ModelConfig
from attnlab.decode import beam_search, generate, greedy_search
from attnlab.models.layers import sinusoidal_positions
from attnlab.models.transformer import build_model
from conftest import jitter

V, D, H, KV, L, FF, THETA = 128, 64, 4, 2, 2, 160, 50000.0
HD = D // H
PAD, BOS, EOS = 0, 1, 2
ATOL, RTOL = 1e-5, 1e-5
LENGTHS = [16, 11, 7]  # a right-padded batch; every sequence longer than 12 in the first row
NEW = 8  # greedy tokens generated per prompt


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


def hf_model(config_cls, model_cls, **kw):
    config = config_cls(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                        max_position_embeddings=64, attn_implementation="eager", bos_token_id=BOS, eos_token_id=EOS,
                        pad_token_id=PAD, **kw)
    torch.manual_seed(0)
    return jitter(model_cls(config).float()).eval()


def copy_linear(ours: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    ours.weight.copy_(weight)
    if bias is not None:
        ours.bias.copy_(bias)


def copy_norm(ours: nn.Module, norm: nn.Module) -> None:
    ours.weight.copy_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        ours.bias.copy_(norm.bias)


def per_head_qkv(w: torch.Tensor) -> torch.Tensor:
    """Rows [q_h; k_h; v_h] per head (GPT-NeoX, BLOOM) -> attnlab's [q; k; v] (view (H, 3, hd, ...), swap)."""
    return w.view(H, 3, HD, *w.shape[1:]).transpose(0, 1).reshape(3 * D, *w.shape[1:])


# ---------------------------------------------------------------------------------------------------
# Weight mapping, one function per HF architecture
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
def load_gemma2(model, hf) -> None:
    """Gemma 2: like Llama, plus the sandwich's norms on each sublayer's output. Gemma's RMSNorm computes
    x_normed * (1 + w): attnlab's weight is 1 + w."""
    base, dec = hf.model, model.decoder
    dec.embed.weight.copy_(base.embed_tokens.weight)
    assert hf.lm_head.weight is base.embed_tokens.weight and model.head is None
    for block, layer in zip(dec.layers, base.layers, strict=True):
        a, mlp = layer.self_attn, layer.mlp
        block.self_attn.qkv_proj.weight.copy_(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
        block.self_attn.out_proj.weight.copy_(a.o_proj.weight)
        block.ffn.fc1.weight.copy_(torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)))
        block.ffn.fc2.weight.copy_(mlp.down_proj.weight)
        slots = ((block.self_attn_norm, layer.input_layernorm), (block.ffn_norm, layer.pre_feedforward_layernorm),
                 (block.self_attn_out_norm, layer.post_attention_layernorm),
                 (block.ffn_out_norm, layer.post_feedforward_layernorm))
        for ours, norm in slots:
            ours.weight.copy_(1.0 + norm.weight)
    dec.norm.weight.copy_(1.0 + base.norm.weight)
    finish(model, hf)


def copy_fused_layers(blocks, layers, attention: str) -> None:
    """GPT-NeoX and BLOOM layers: query_key_value rows per head [q_h; k_h; v_h], biases everywhere, the norms
    input_layernorm and post_attention_layernorm before attention and MLP (the parallel or the serial block)."""
    for block, layer in zip(blocks, layers, strict=True):
        a, mlp = getattr(layer, attention), layer.mlp
        qkv = a.query_key_value
        copy_linear(block.self_attn.qkv_proj, per_head_qkv(qkv.weight), per_head_qkv(qkv.bias))
        copy_linear(block.self_attn.out_proj, a.dense.weight, a.dense.bias)
        copy_linear(block.ffn.fc1, mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias)
        copy_linear(block.ffn.fc2, mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias)
        copy_norm(block.self_attn_norm, layer.input_layernorm)
        copy_norm(block.ffn_norm, layer.post_attention_layernorm)


@torch.no_grad()
def load_neox(model, hf) -> None:
    """GPT-NeoX: a parallel block with two norms, an untied head."""
    base, dec = hf.gpt_neox, model.decoder
    dec.embed.weight.copy_(base.embed_in.weight)
    copy_fused_layers(dec.layers, base.layers, "attention")
    copy_norm(dec.norm, base.final_layer_norm)
    model.head.weight.copy_(hf.lm_head.weight)
    finish(model, hf)


@torch.no_grad()
def load_bloom(model, hf) -> None:
    """BLOOM: word_embeddings_layernorm -> embed_norm; serial pre-norm layers laid out as GPT-NeoX's; tied head."""
    base, dec = hf.transformer, model.decoder
    dec.embed.weight.copy_(base.word_embeddings.weight)
    assert hf.lm_head.weight is base.word_embeddings.weight and model.head is None
    copy_norm(dec.embed_norm, base.word_embeddings_layernorm)
    copy_fused_layers(dec.layers, base.h, "self_attention")
    copy_norm(dec.norm, base.ln_f)
    finish(model, hf)


@torch.no_grad()
def load_falcon(model, hf) -> None:
    """Falcon (7B layout): multi-query query_key_value rows are [q (H heads); k; v], attnlab's order. Its parallel
    block has ONE input_layernorm read by attention and MLP: attnlab's two pre-norms both get its weights."""
    base, dec = hf.transformer, model.decoder
    dec.embed.weight.copy_(base.word_embeddings.weight)
    assert hf.lm_head.weight is base.word_embeddings.weight and model.head is None
    for block, layer in zip(dec.layers, base.h, strict=True):
        a, mlp = layer.self_attention, layer.mlp
        copy_linear(block.self_attn.qkv_proj, a.query_key_value.weight)
        copy_linear(block.self_attn.out_proj, a.dense.weight)
        copy_linear(block.ffn.fc1, mlp.dense_h_to_4h.weight)
        copy_linear(block.ffn.fc2, mlp.dense_4h_to_h.weight)
        copy_norm(block.self_attn_norm, layer.input_layernorm)
        copy_norm(block.ffn_norm, layer.input_layernorm)
    copy_norm(dec.norm, base.ln_f)
    finish(model, hf)


@torch.no_grad()
def load_gpt2(model, hf) -> None:
    """GPT-2: Conv1D weights are (in, out), transposed here; c_attn columns are [q; k; v]."""
    base, dec = hf.transformer, model.decoder
    dec.embed.weight.copy_(base.wte.weight)
    dec.positions.table.weight.copy_(base.wpe.weight)
    assert hf.lm_head.weight is base.wte.weight and model.head is None
    for block, layer in zip(dec.layers, base.h, strict=True):
        copy_linear(block.self_attn.qkv_proj, layer.attn.c_attn.weight.T, layer.attn.c_attn.bias)
        copy_linear(block.self_attn.out_proj, layer.attn.c_proj.weight.T, layer.attn.c_proj.bias)
        copy_linear(block.ffn.fc1, layer.mlp.c_fc.weight.T, layer.mlp.c_fc.bias)
        copy_linear(block.ffn.fc2, layer.mlp.c_proj.weight.T, layer.mlp.c_proj.bias)
        copy_norm(block.self_attn_norm, layer.ln_1)
        copy_norm(block.ffn_norm, layer.ln_2)
    copy_norm(dec.norm, base.ln_f)
    finish(model, hf)


@torch.no_grad()
def load_bert(model, bert) -> None:
    """BERT: embeddings.LayerNorm -> embed_norm; the token-type embedding of type 0, added at every position, is
    folded into the learned position table (word + position + type0 = word + (position + type0)); post-norm
    slots after attention and after the FFN. BERT's MLM head (dense + GELU + LayerNorm, then the tied output) has
    no attnlab counterpart, so the encoders' outputs are compared; attnlab's head is the tied table."""
    emb, enc = bert.embeddings, model.encoder
    enc.embed.weight.copy_(emb.word_embeddings.weight)
    enc.positions.table.weight.copy_(emb.position_embeddings.weight + emb.token_type_embeddings.weight[0])
    copy_norm(enc.embed_norm, emb.LayerNorm)
    for block, layer in zip(enc.layers, bert.encoder.layer, strict=True):
        s, out = layer.attention.self, layer.attention.output
        copy_linear(block.self_attn.qkv_proj, torch.cat((s.query.weight, s.key.weight, s.value.weight)),
                    torch.cat((s.query.bias, s.key.bias, s.value.bias)))
        copy_linear(block.self_attn.out_proj, out.dense.weight, out.dense.bias)
        copy_norm(block.self_attn_post_norm, out.LayerNorm)
        copy_linear(block.ffn.fc1, layer.intermediate.dense.weight, layer.intermediate.dense.bias)
        copy_linear(block.ffn.fc2, layer.output.dense.weight, layer.output.dense.bias)
        copy_norm(block.ffn_post_norm, layer.output.LayerNorm)
    finish(model, bert)


def copy_self_attention(ours, a) -> None:
    copy_linear(ours.qkv_proj, torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
                torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)))
    copy_linear(ours.out_proj, a.out_proj.weight, a.out_proj.bias)


@torch.no_grad()
def load_marian(model, hf) -> None:
    """Marian: one shared table (source, target, output); q/k/v_proj -> qkv_proj [q; k; v], cross-attention's
    k/v_proj -> kv_proj [k; v]; post-norm slots. Marian's sinusoid table puts the sines in the first half and the
    cosines in the second (attnlab interleaves them, as the paper's formula): attnlab's table is copied into
    Marian's frozen position embeddings, so both add the same positions (the logit tests prove the rest of the
    model; test_marian_sinusoids_are_attnlabs_table_with_sines_first proves the table against Marian's own)."""
    m = hf.model
    assert m.encoder.embed_tokens.weight is m.shared.weight is hf.lm_head.weight and model.head is None
    assert not hf.final_logits_bias.any()  # a zero buffer: attnlab has no output bias
    model.decoder.embed.weight.copy_(m.shared.weight)  # the encoder's table is the same object
    table = sinusoidal_positions(torch.arange(m.encoder.embed_positions.weight.shape[0]), D)  # (P, d)
    m.encoder.embed_positions.weight.copy_(table)
    m.decoder.embed_positions.weight.copy_(table)
    for block, layer in zip(model.encoder.layers, m.encoder.layers, strict=True):
        copy_self_attention(block.self_attn, layer.self_attn)
        copy_norm(block.self_attn_post_norm, layer.self_attn_layer_norm)
        copy_linear(block.ffn.fc1, layer.fc1.weight, layer.fc1.bias)
        copy_linear(block.ffn.fc2, layer.fc2.weight, layer.fc2.bias)
        copy_norm(block.ffn_post_norm, layer.final_layer_norm)
    for block, layer in zip(model.decoder.layers, m.decoder.layers, strict=True):
        copy_self_attention(block.self_attn, layer.self_attn)
        copy_norm(block.self_attn_post_norm, layer.self_attn_layer_norm)
        c = layer.encoder_attn
        copy_linear(block.cross_attn.q_proj, c.q_proj.weight, c.q_proj.bias)
        copy_linear(block.cross_attn.kv_proj, torch.cat((c.k_proj.weight, c.v_proj.weight)),
                    torch.cat((c.k_proj.bias, c.v_proj.bias)))
        copy_linear(block.cross_attn.out_proj, c.out_proj.weight, c.out_proj.bias)
        copy_norm(block.cross_attn_post_norm, layer.encoder_attn_layer_norm)
        copy_linear(block.ffn.fc1, layer.fc1.weight, layer.fc1.bias)
        copy_linear(block.ffn.fc2, layer.fc2.weight, layer.fc2.bias)
        copy_norm(block.ffn_post_norm, layer.final_layer_norm)
    finish(model, hf)


# ---------------------------------------------------------------------------------------------------
# The comparisons
# ---------------------------------------------------------------------------------------------------
def padded(lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) right-padded with PAD (tokens drawn from 4..V-1, never a special id), and the mask (B, T)."""
    ids = torch.randint(4, V, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]  # (B, T) True at real tokens
    return ids.masked_fill(~mask, PAD), mask


def check_causal_lm(model, hf) -> None:
    """Logits on the padded batch, KV-cache decoding, and greedy generation over the cache."""
    x, mask = padded()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask.long()).logits  # (B, T, V)
        torch.testing.assert_close(model(x)[mask], want[mask], atol=ATOL, rtol=RTOL)
        # KV cache: a 5-token prompt, a 3-token chunk on top of the cache, then one token at a time
        cache = model.new_cache()
        steps = [model(x[:, :5], cache=cache), model(x[:, 5:8], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(8, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1)[mask], want[mask], atol=ATOL, rtol=RTOL)
    prompts = [row[:n] for row, n in zip(x, LENGTHS, strict=True)]
    got = generate(model, prompts, max_new_tokens=NEW, greedy=True)  # one call: grouped by length
    for prompt, ours in zip(prompts, got, strict=True):
        theirs = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=PAD)
        assert ours == theirs[0].tolist()
    # HF's batched path: all prompts at once, left-padded, with their attention mask (and the positions HF
    # derives from it): token for token what attnlab's per-length groups give
    width = max(LENGTHS)
    left = torch.full((len(prompts), width), PAD, dtype=torch.long)  # (B, T)
    for i, p in enumerate(prompts):
        left[i, width - len(p):] = p
    real = torch.arange(width)[None, :] >= width - torch.tensor(LENGTHS)[:, None]  # (B, T)
    with torch.no_grad():
        batched = hf.generate(left, attention_mask=real.long(), max_new_tokens=NEW, do_sample=False, num_beams=1,
                              eos_token_id=None, pad_token_id=PAD)
    assert [row[width - n:].tolist() for row, n in zip(batched, LENGTHS, strict=True)] == got


@pytest.mark.parametrize("tie,backend,kv", [("none", "sdpa", KV), ("decoder", "eager", KV), ("none", "sdpa", 1)],
                         ids=["gqa", "gqa-tied-eager", "mqa"])
def test_llama(tie, backend, kv):
    """Pre-norm RMSNorm, SwiGLU, RoPE; GQA, and MQA (num_key_value_heads=1)."""
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, intermediate_size=FF,
                  num_key_value_heads=kv, rms_norm_eps=1e-6, tie_word_embeddings=tie != "none",
                  rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False,
                  mlp_bias=False)
    model = attnlab_model(n_kv_heads=kv, norm="rmsnorm", norm_eps=1e-6, ffn="swiglu", attn_bias=False,
                          ffn_bias=False, tie_embeddings=tie, attention_backend=backend)
    assert model.decoder.layers[0].self_attn.n_kv == kv
    load_llama_like(model, hf)
    check_causal_lm(model, hf)


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
    check_causal_lm(model, hf)


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
    check_causal_lm(model, hf)


def test_gemma2():
    """Sandwich RMSNorm, GeGLU, GQA, scaled (and tied) embeddings, attention and final-logit soft-capping. The caps
    are low enough to change the logits (checked). Gemma 2 alternates sliding-window and global layers; attnlab has
    no sliding window, so the window (64) is longer than every sequence here and both layer kinds see everything.
    HF's default GeGLU is the tanh approximation of GELU; hidden_activation="gelu" is the exact one, attnlab's."""
    kw = dict(intermediate_size=FF, num_key_value_heads=KV, head_dim=HD, rms_norm_eps=1e-6, hidden_activation="gelu",
              query_pre_attn_scalar=HD, sliding_window=64, tie_word_embeddings=True, attention_bias=False,
              rope_parameters={"rope_type": "default", "rope_theta": THETA})
    hf = hf_model(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, attn_logit_softcapping=1.0,
                  final_logit_softcapping=2.0, **kw)
    assert hf.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    model = attnlab_model(n_kv_heads=KV, norm="rmsnorm", norm_eps=1e-6, norm_position="sandwich", ffn="geglu",
                          attn_bias=False, ffn_bias=False, tie_embeddings="decoder", scale_embeddings=True,
                          attn_softcap=1.0, logit_softcap=2.0, attention_backend="eager")
    load_gemma2(model, hf)
    check_causal_lm(model, hf)
    uncapped = hf_model(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, attn_logit_softcapping=None,
                        final_logit_softcapping=None, **kw)
    x, mask = padded()
    with torch.no_grad():
        assert not torch.allclose(uncapped(input_ids=x).logits, hf(input_ids=x).logits, atol=0.1)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_bloom(backend):
    """ALiBi, LayerNorm, GELU, the LayerNorm right after the embeddings (embed_norm), tied output. BLOOM adds
    slope * key position to the scores where attnlab adds -slope * |query - key|: under the causal mask the two
    differ by a constant per query row, which the softmax removes. BLOOM's MLP uses the tanh approximation of GELU
    (hard-coded in BloomGelu); the test puts the exact GELU (attnlab's `gelu`) in its place."""
    hf = hf_model(transformers.BloomConfig, transformers.BloomForCausalLM, layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True)
    for layer in hf.transformer.h:
        layer.mlp.gelu_impl = nn.GELU()
    model = attnlab_model(norm="layernorm", norm_eps=1e-5, ffn="gelu", d_ff=4 * D, position="alibi",
                          embed_norm=True, tie_embeddings="decoder", attention_backend=backend)
    load_bloom(model, hf)
    check_causal_lm(model, hf)


def test_falcon():
    """Falcon-7B's layout: a parallel attention + MLP block reading one LayerNorm, multi-query attention, RoPE,
    no linear biases, exact GELU, tied output."""
    hf = hf_model(transformers.FalconConfig, transformers.FalconForCausalLM, multi_query=True,
                  new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, activation="gelu",
                  layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": THETA})
    assert hf.transformer.h[0].self_attention.num_kv_heads == 1
    model = attnlab_model(n_kv_heads=1, norm="layernorm", norm_eps=1e-5, ffn="gelu", d_ff=4 * D, block="parallel",
                          attn_bias=False, ffn_bias=False, tie_embeddings="decoder")
    load_falcon(model, hf)
    check_causal_lm(model, hf)


def test_gpt2():
    """Learned positions, pre-norm LayerNorm, GELU (exact: activation_function="gelu"), tied output."""
    hf = hf_model(transformers.GPT2Config, transformers.GPT2LMHeadModel, activation_function="gelu",
                  layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = attnlab_model(norm="layernorm", norm_eps=1e-5, ffn="gelu", d_ff=4 * D, position="learned",
                          tie_embeddings="decoder")
    load_gpt2(model, hf)
    check_causal_lm(model, hf)


def bert_and_model(norm: str = "layernorm"):
    hf = hf_model(transformers.BertConfig, lambda c: transformers.BertModel(c, add_pooling_layer=False),
                  intermediate_size=4 * D, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  type_vocab_size=2, layer_norm_eps=1e-12)
    model = attnlab_model(arch="encoder_only", n_enc_layers=L, norm=norm, norm_eps=1e-12, norm_position="post",
                          ffn="gelu", d_ff=4 * D, position="learned", embed_norm=True, tie_embeddings="decoder")
    return hf, model


def check_encoder(model, hf) -> None:
    """Bidirectional: the encoder's outputs at every real position of the padded batch, and the logits of
    attnlab's tied head on them."""
    x, mask = padded()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask.long(), token_type_ids=torch.zeros_like(x)).last_hidden_state
        got = model(x, return_hidden=True)  # (B, T, d)
        torch.testing.assert_close(got[mask], want[mask], atol=ATOL, rtol=RTOL)
        logits = want @ model.encoder.embed.weight.T  # (B, T, V)
        torch.testing.assert_close(model(x)[mask], logits[mask], atol=ATOL, rtol=RTOL)


def test_bert():
    """Encoder-only, post-norm LayerNorm, GELU, learned positions, the embedding LayerNorm (embed_norm)."""
    hf, model = bert_and_model()
    load_bert(model, hf)
    check_encoder(model, hf)


def test_post_norm_rmsnorm():
    """Post-norm RMSNorm has no HF model; test_bert (the post-norm slots) and test_llama (the RMSNorm) cover it
    together. Here HF's own BERT runs with HF's own Llama RMSNorm in every one of its norm slots."""
    hf, model = bert_and_model(norm="rmsnorm")
    layer_norms = [(parent, name) for parent in hf.modules() for name, child in parent.named_children()
                   if isinstance(child, nn.LayerNorm)]
    assert len(layer_norms) == 1 + 2 * L
    g = torch.Generator().manual_seed(3)
    for parent, name in layer_norms:
        rms = transformers.models.llama.modeling_llama.LlamaRMSNorm(D, eps=1e-12)
        with torch.no_grad():
            rms.weight.add_(0.1 * torch.randn(D, generator=g))
        setattr(parent, name, rms)
    load_bert(model, hf)
    check_encoder(model, hf)


# ---------------------------------------------------------------------------------------------------
# Marian: encoder-decoder, greedy and beam search
# ---------------------------------------------------------------------------------------------------
class FairseqForcedEOS(transformers.LogitsProcessor):
    """attnlab's beam search (as fairseq's) ends every live hypothesis at the maximum length with EOS, scored with
    EOS's own log-probability. HF's `forced_eos_token_id` would give that EOS log-probability 0 instead, so the
    comparison hands HF this processor: at the last step only EOS remains, its log-probability kept."""

    def __init__(self, at_length: int) -> None:
        self.at_length = at_length  # decoder input length (start token + tokens) at the forced step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.at_length:
            return scores
        return torch.full_like(scores, -math.inf).index_copy_(1, torch.tensor([EOS]), scores[:, EOS:EOS + 1])


@pytest.fixture(scope="module")
def marian():
    config = transformers.MarianConfig(
        vocab_size=V, d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=H,
        decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, activation_function="relu", dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64, scale_embedding=True,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = jitter(transformers.MarianMTModel(config).float()).eval()
    with torch.no_grad():
        # a random model almost never ends a hypothesis by EOS: move the shared table's EOS row along the last
        # decoder norm's bias, which raises EOS's logit by about 2.5 at every step (the same weights in both
        # models), so hypotheses end at varied lengths and the length penalty has choices to rank
        beta = hf.model.decoder.layers[-1].final_layer_norm.bias
        hf.model.shared.weight[EOS] += 2.5 * beta / beta.pow(2).sum()
    model = attnlab_model(arch="encoder_decoder", n_enc_layers=L, norm="layernorm", norm_eps=1e-5,
                          norm_position="post", ffn="relu", position="sinusoidal", tie_embeddings="all",
                          scale_embeddings=True, attn_bias=True, ffn_bias=True)
    load_marian(model, hf)
    return model, hf


def test_marian_sinusoids_are_attnlabs_table_with_sines_first():
    """The proof of `position: sinusoidal` against an independent table: HF's own Marian code (its
    `create_weight`, in float64 numpy, and what a fresh MarianMTModel holds) puts every frequency's sine in the
    first half and its cosine in the second; attnlab's table, computed by attnlab and interleaved as the paper's
    PE(pos, 2i), PE(pos, 2i+1), equals it with its even columns first, then its odd ones (the order the export
    writes). The logit tests then copy one table into both models."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    positions = 64
    theirs = MarianSinusoidalPositionalEmbedding(positions, D).create_weight()  # (P, d)
    fresh = transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=H,
        decoder_attention_heads=H, max_position_embeddings=positions, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, decoder_start_token_id=BOS)).model.encoder.embed_positions.weight
    torch.testing.assert_close(fresh, theirs, atol=0, rtol=0)
    ours = sinusoidal_positions(torch.arange(positions), D)  # (P, d) interleaved
    perm = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))
    torch.testing.assert_close(ours[:, perm], theirs, atol=2e-5, rtol=0)
    assert not torch.allclose(ours, theirs, atol=1e-2)  # not the same layout without the permutation


def sources(seed: int = 5) -> torch.Tensor:
    return padded([14, 9, 5, 12], seed=seed)[0]  # (4, 14)


def test_marian_logits(marian):
    """Post-norm encoder-decoder, ReLU, sinusoidal positions, scaled embeddings shared by source, target and
    output: logits of a padded target batch over a padded source batch."""
    model, hf = marian
    src = sources()
    tgt, tmask = padded([13, 6, 10, 3], seed=6)
    tgt[:, 0] = BOS
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=src.ne(PAD).long(), decoder_input_ids=tgt).logits  # (B, T, V)
        torch.testing.assert_close(model(src, tgt)[tmask], want[tmask], atol=ATOL, rtol=RTOL)


def hf_outputs(sequences: torch.Tensor) -> list[list[int]]:
    """HF's generated rows -> token lists without the start token, cut at EOS, as attnlab returns them."""
    out = []
    for row in sequences[:, 1:].tolist():
        out.append(row[: row.index(EOS)] if EOS in row else [t for t in row if t != PAD])
    return out


def test_marian_greedy(marian):
    model, hf = marian
    src = sources()
    got = greedy_search(model, src, max_len_a=0.0, max_len_b=10)
    with torch.no_grad():
        out = hf.generate(input_ids=src, attention_mask=src.ne(PAD).long(), num_beams=1, do_sample=False,
                          max_new_tokens=10, suppress_tokens=[PAD])
    assert got == hf_outputs(out)


@pytest.mark.parametrize("alpha", [0.6, 1.5])
def test_marian_beam_search(marian, alpha):
    """attnlab's beam 4 with fairseq's length penalty (score = log p(y + EOS) / (|y| + 1)^alpha) against HF's
    generate(num_beams=4, length_penalty=alpha, early_stopping=True): the same 4-best lists, in the same order,
    with the same scores, for a batch of padded sources. Matched: EOS, PAD never generated (suppress_tokens), the
    maximum length (attnlab's max_len_b = 10 tokens + the forced EOS = HF's 11 new tokens) and how it ends a
    hypothesis (FairseqForcedEOS). Some hypotheses end by EOS before the limit, some at it (checked)."""
    model, hf = marian
    src, limit = sources(), 10
    got = beam_search(model, src, beam_size=4, len_penalty=alpha, penalty="fairseq", max_len_a=0.0, max_len_b=limit,
                      nbest=4)
    with torch.no_grad():
        out = hf.generate(input_ids=src, attention_mask=src.ne(PAD).long(), num_beams=4, num_return_sequences=4,
                          length_penalty=alpha, early_stopping=True, do_sample=False, max_new_tokens=limit + 1,
                          suppress_tokens=[PAD], logits_processor=[FairseqForcedEOS(limit + 1)],
                          output_scores=True, return_dict_in_generate=True)
    theirs = hf_outputs(out.sequences)
    for b, nbest in enumerate(got):
        assert [hyp for hyp, _ in nbest] == theirs[4 * b: 4 * b + 4], b
        torch.testing.assert_close(torch.tensor([s for _, s in nbest]), out.sequences_scores[4 * b: 4 * b + 4],
                                   atol=1e-4, rtol=1e-5)
    lengths = {len(hyp) for nbest in got for hyp, _ in nbest}
    assert limit in lengths and min(lengths) < limit - 2  # ended by EOS early, and at the maximum length
