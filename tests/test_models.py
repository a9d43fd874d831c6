"""The whole variant grid: builds, trains (finite grads everywhere), KV cache == full forward, causality,
padding invariance, sdpa == eager == flash_attn (a plain-PyTorch stand-in on CPU), accounting == built model.
The equality checks run on jittered weights (conftest.jitter: biases away from 0, norms away from 1), so a bias or
a norm that one code path drops (the cached decoder's cross-attention K/V bias, say) changes its outputs.

Every axis is read from `attnlab.config.CHOICES`, so a new choice there is in the grid without editing this file."""

import itertools
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.config import CHOICES, ModelConfig
from attnlab.models import attention
from attnlab.models.accounting import count_parameters
from attnlab.models.attention import Attention, Mask
from attnlab.models.block import Block
from attnlab.models.transformer import build_model
from conftest import jitter
from dispatch_count import DispatchCount

ARCHS = list(CHOICES["arch"])
POSITIONS = list(CHOICES["position"])
GRID = list(itertools.product(ARCHS, CHOICES["norm"], CHOICES["norm_position"], CHOICES["block"], POSITIONS))
INNER = list(itertools.product(CHOICES["ffn"], [False, True]))  # ffn x qk_norm
# Cycled over INNER, so every outer variant meets MHA, GQA and MQA, each bias switch off and each tying mode.
EXTRAS = [
    dict(n_kv_heads=4, tie_embeddings="all"),
    dict(n_kv_heads=2, attn_bias=False, ffn_bias=False, tie_embeddings="none", head_dim=12),  # d_k != d_model / h
    dict(n_kv_heads=4, tie_embeddings="all", head_dim=4, v_head_dim=10),  # d_k != d_v (Vaswani et al. Table 3 (B))
    dict(n_kv_heads=1, norm_bias=False, tie_embeddings="decoder", scale_embeddings=False, embed_norm=True),
]
BACKENDS = list(CHOICES["attention_backend"])
V = 37


# ---------------------------------------------------------------------------------------------------------
# A plain-PyTorch stand-in for the flash-attn package: its documented semantics (B, T, H, hd) layout, GQA by
# fewer K/V heads, a bottom-right aligned causal mask, tanh soft-capping after scaling, varlen by cu_seqlens.
# It checks attnlab's flash_attn wiring on CPU; the real kernel needs CUDA.
# ---------------------------------------------------------------------------------------------------------
def _reference_attention(q, k, v, causal, softcap):
    """q (Tq, H, hd), k/v (Tk, Hkv, hd) of ONE sequence -> (Tq, H, hd)."""
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # (Tk, H, hd)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(hd)  # (H, Tq, Tk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        i, j = torch.arange(Tq)[:, None], torch.arange(Tk)[None, :]
        s = s.masked_fill(j > i + Tk - Tq, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double()).to(q.dtype)  # (Tq, H, hd)


def fake_flash_attn(half_only: bool = False) -> types.ModuleType:
    """`half_only`: refuse fp32 inputs as the CUDA kernel does (q, k, v must share one dtype, fp16 or bf16)."""
    mod = types.ModuleType("flash_attn")

    def check_dtypes(q, k, v):
        assert q.dtype == k.dtype == v.dtype, f"flash-attn: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
        assert not half_only or q.dtype in (torch.float16, torch.bfloat16), f"flash-attn: {q.dtype} is not 16-bit"

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, softcap=0.0, **kw):
        assert dropout_p == 0.0 and softmax_scale is None and not kw
        check_dtypes(q, k, v)
        return torch.stack([_reference_attention(q[b], k[b], v[b], causal, softcap) for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               softcap=0.0, **kw):
        assert dropout_p == 0.0 and softmax_scale is None and not kw
        check_dtypes(q, k, v)
        # max_seqlen_q/k bound the lengths (the kernel sizes its grid with them): a bound, not the exact maximum
        assert cu_q.dtype == cu_k.dtype == torch.int32 and int((cu_q[1:] - cu_q[:-1]).max()) <= max_q
        assert int((cu_k[1:] - cu_k[:-1]).max()) <= max_k and q.shape[0] == cu_q[-1] and k.shape[0] == cu_k[-1]
        outs = [_reference_attention(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], causal,
                                     softcap) for b in range(len(cu_q) - 1)]
        return torch.cat(outs)  # (total_q, H, hd)

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return mod


@pytest.fixture(autouse=True)
def flash_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())


def test_flash_stand_in_aligns_causal_bottom_right():
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 3, 1, 4)
    out = fake_flash_attn().flash_attn_func(q, k, k, causal=True)  # (1, 2, 1, 4)
    w_last = (q[0, 1, 0] @ k[0].squeeze(1).T / 2).softmax(-1)  # the last query sees all 3 keys
    torch.testing.assert_close(out[0, 1, 0], w_last @ k[0].squeeze(1))


# ---------------------------------------------------------------------------------------------------------
def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_kv_heads=2, n_enc_layers=2, n_dec_layers=2,
                ffn_multiple_of=16, max_seq_len=64, dropout=0.0, attn_bias=True, ffn_bias=True)
    base.update(kw)
    return ModelConfig(**base)


def tokens(B, T, seed=0, low=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, V, (B, T), generator=g)


def run(model, cfg, src, tgt):
    if cfg.arch == "encoder_decoder":
        return model(src, tgt)
    return model(tgt if cfg.arch == "decoder_only" else src)


def set_backend(model, backend: str) -> None:
    """Switch every attention module of a built model (the same weights) to another backend."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


def backends_for(cfg: ModelConfig) -> list[str]:
    # the config forbids flash_attn with ALiBi, and with a value size apart from the key size
    return [b for b in BACKENDS if not (b == "flash_attn" and (cfg.position == "alibi" or cfg.d_v != cfg.d_k))]


@pytest.mark.parametrize("arch,norm,norm_position,block,position", GRID)
def test_variant_grid(arch, norm, norm_position, block, position):
    torch.manual_seed(0)
    src, tgt = tokens(2, 7, 1), tokens(2, 6, 2)
    src[1, 5:] = 0  # real padding in the source
    for i, (ffn, qk_norm) in enumerate(INNER):
        cfg = tiny(arch=arch, norm=norm, norm_position=norm_position, block=block, position=position, ffn=ffn,
                   qk_norm=qk_norm, dropout=0.1, attn_dropout=0.1, **EXTRAS[i % len(EXTRAS)])
        model = jitter(build_model(cfg), seed=i)
        # exact accounting, from the config alone
        assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters()), cfg
        # forward + backward in train mode; every parameter gets a finite gradient
        out = run(model, cfg, src, tgt)
        assert out.shape == (2, src.shape[1] if arch == "encoder_only" else tgt.shape[1], V)
        out.float().pow(2).mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{cfg}: {name} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        # every backend gives the same outputs (eval mode: no dropout); KV-cache decoding gives them too, with
        # sdpa for every config and with eager or flash_attn in turn
        model.eval()
        backends = backends_for(cfg)
        with torch.no_grad():
            ref = run(model, cfg, src, tgt)
            for backend in backends:
                set_backend(model, backend)
                torch.testing.assert_close(run(model, cfg, src, tgt), ref, atol=1e-5, rtol=1e-4, msg=backend)
                if arch != "encoder_only" and backend in ("sdpa", backends[1 + i % (len(backends) - 1)]):
                    check_cache(model, cfg, src, tgt, ref)


def check_cache(model, cfg, src, tgt, full):
    """Incremental decoding over the KV cache gives the full forward's logits: a prefix chunk, then single
    tokens, then a chunk after a cached prefix (the bottom-right causal mask). Cross-attention keys and values
    are computed once per source, at the first step."""
    cache = model.new_cache()
    kv_calls = []
    hooks = [blk.cross_attn.kv_proj.register_forward_hook(lambda *a: kv_calls.append(1))
             for blk in model.decoder.layers if blk.cross]
    if cfg.arch == "encoder_decoder":
        memory, src_pad = model.encode(src)
        step = lambda ids: model.decode(ids, memory, src_pad, cache=cache)  # noqa: E731
    else:
        step = lambda ids: model(ids, cache=cache)  # noqa: E731
    try:
        pieces = [step(tgt[:, :2]), step(tgt[:, 2:3]), step(tgt[:, 3:4]), step(tgt[:, 4:6])]
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.pos == tgt.shape[1]
    assert len(kv_calls) == (cfg.n_dec_layers if cfg.arch == "encoder_decoder" else 0)


def test_cache_reorder_follows_the_surviving_hypotheses():
    """Beam search reorders the cache rows; decoding on continues as if the reordered batch had been fed."""
    cfg = tiny(position="rope", norm_position="pre")
    model = jitter(build_model(cfg)).eval()
    src, tgt = tokens(3, 6, 1), tokens(3, 5, 2)
    src[2, 4:] = 0
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        memory, src_pad = model.encode(src)
        cache = model.new_cache()
        model.decode(tgt[:, :3], memory, src_pad, cache=cache)
        cache.reorder(order)
        got = model.decode(tgt[order, 3:], memory[order], src_pad[order], cache=cache)
        want = model(src[order], tgt[order])[:, 3:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_causality(arch, position, backend):
    """Changing a future token never changes an earlier output."""
    torch.manual_seed(0)
    cfg = tiny(arch=arch, position=position, norm_position="pre", attention_backend=backend)
    model = jitter(build_model(cfg)).eval()
    src, tgt = tokens(2, 8, 3), tokens(2, 9, 4)
    base = run(model, cfg, src, tgt)
    for t in range(tgt.shape[1]):
        changed = tgt.clone()
        changed[:, t] = (changed[:, t] + 1 - 4) % (V - 4) + 4
        out = run(model, cfg, src, changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(out[:, t:], base[:, t:])  # the change is visible from position t on


@pytest.mark.parametrize("arch", ["encoder_decoder", "encoder_only"])
@pytest.mark.parametrize("position", POSITIONS)
def test_padding_never_changes_real_outputs(arch, position):
    """A sentence batched with a longer one (so padded) gives the outputs it gives alone, through the
    encoder's self-attention and the decoder's cross-attention, on every backend."""
    torch.manual_seed(0)
    cfg = tiny(arch=arch, position=position, qk_norm=True)
    model = jitter(build_model(cfg)).eval()
    short, long_ = tokens(1, 5, 5), tokens(1, 9, 6)
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, :5], batch[1] = short[0], long_[0]
    tgt = tokens(2, 4, 7)
    with torch.no_grad():
        for backend in backends_for(cfg):
            set_backend(model, backend)
            if arch == "encoder_decoder":
                alone, batched = model(short, tgt[:1]), model(batch, tgt)
                torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-4, msg=backend)
                torch.testing.assert_close(batched[1], model(long_, tgt[1:])[0], atol=1e-5, rtol=1e-4, msg=backend)
            else:
                alone, batched = model(short), model(batch)
                torch.testing.assert_close(batched[0, :5], alone[0], atol=1e-5, rtol=1e-4, msg=backend)


@pytest.mark.parametrize("position", ["sinusoidal", "alibi"])
def test_a_source_of_only_padding_is_finite_and_the_same_on_every_backend(position):
    """Its queries see no key at all: every backend gives a zero attention output there, never NaN."""
    cfg = tiny(position=position)
    model = jitter(build_model(cfg)).eval()
    src, tgt = tokens(2, 5, 1), tokens(2, 4, 2)
    src[1] = 0
    with torch.no_grad():
        outs = {}
        for backend in backends_for(cfg):
            set_backend(model, backend)
            outs[backend] = model(src, tgt)
            assert torch.isfinite(outs[backend]).all(), backend
    for backend, out in outs.items():
        torch.testing.assert_close(out, outs["sdpa"], atol=1e-5, rtol=1e-4, msg=backend)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_mha_gqa_mqa_share_kv_heads(n_kv_heads):
    cfg = tiny(arch="decoder_only", n_heads=4, n_kv_heads=n_kv_heads, position="rope")
    model = jitter(build_model(cfg))
    qkv = model.decoder.layers[0].self_attn.qkv_proj
    assert qkv.out_features == (4 + 2 * n_kv_heads) * cfg.d_k
    model.eval()
    ids = tokens(2, 6)
    for backend in ("eager", "flash_attn"):  # built from the config, not switched
        other = build_model(cfg.replace(attention_backend=backend)).eval()
        other.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(ids), other(ids), atol=1e-5, rtol=1e-4)


def test_sdpa_gqa_without_enable_gqa(monkeypatch):
    """torch < 2.5 has no enable_gqa: the K/V heads are repeated before SDPA instead, with the same result."""
    cfg = tiny(arch="decoder_only", n_kv_heads=1, position="rope")
    model = jitter(build_model(cfg)).eval()
    ids = tokens(2, 6)
    with torch.no_grad():
        want = model(ids)
        monkeypatch.setattr(attention, "SDPA_GQA", False)
        real = F.scaled_dot_product_attention

        def old_sdpa(q, k, v, **kw):
            assert "enable_gqa" not in kw and q.shape[1] == k.shape[1]
            return real(q, k, v, **kw)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", old_sdpa)
        torch.testing.assert_close(model(ids), want, atol=1e-6, rtol=1e-5)


def test_tied_embeddings_share_one_table():
    m = build_model(tiny(tie_embeddings="all"))
    assert m.encoder.embed is m.decoder.embed and m.head is None
    m = build_model(tiny(tie_embeddings="decoder", src_vocab_size=20))
    assert m.encoder.embed is not m.decoder.embed and m.head is None and m.encoder.embed.num_embeddings == 20
    m = build_model(tiny(tie_embeddings="none"))
    assert m.head is not None and m.head.weight is not m.decoder.embed.weight


def test_logit_softcap_caps_the_output_logits():
    """logit_softcap: logits = c * tanh(logits / c) on the vocabulary projection (Gemma 2)."""
    cfg = tiny(arch="decoder_only", logit_softcap=2.0)
    model = build_model(cfg)
    with torch.no_grad():
        model.decoder.embed.weight.mul_(100)
    out = model(tokens(2, 5))
    assert out.abs().max() <= 2.0
    plain = build_model(cfg.replace(logit_softcap=0.0))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, 2.0 * torch.tanh(plain(tokens(2, 5)) / 2.0))


@pytest.mark.parametrize("backend", ["eager", "flash_attn"])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_attn_softcap_caps_the_scores_before_the_softmax(backend, n_kv_heads):
    """attn_softcap: softmax(c * tanh(q k^T / sqrt(hd) / c)) v (Gemma 2), computed here by hand."""
    torch.manual_seed(0)
    c = 0.5
    cfg = tiny(arch="decoder_only", attn_softcap=c, attention_backend=backend, n_kv_heads=n_kv_heads,
               attn_bias=False)
    attn = Attention(cfg).eval()
    with torch.no_grad():
        attn.qkv_proj.weight.mul_(20)  # large scores: capping changes the result a lot
        x = torch.randn(2, 6, cfg.d_model)  # (B, T, d)
        got = attn(x, Mask(causal=True))
        hd, H, Hkv = cfg.d_k, cfg.n_heads, cfg.kv_heads
        q, k, v = (x @ attn.qkv_proj.weight.T).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = q.view(2, 6, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k, v = (t.view(2, 6, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1) for t in (k, v))
        s = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, H, T, T)
        future = torch.ones(6, 6, dtype=torch.bool).triu(1)
        capped = (c * torch.tanh(s / c)).masked_fill(future, float("-inf")).softmax(-1)
        uncapped = s.masked_fill(future, float("-inf")).softmax(-1)
        want = attn.out_proj((capped @ v).transpose(1, 2).reshape(2, 6, -1))
        plain = attn.out_proj((uncapped @ v).transpose(1, 2).reshape(2, 6, -1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-2)  # the cap matters at these scores
    if backend == "eager":
        attn.keep_weights = True
        attn(x, Mask(causal=True))
        torch.testing.assert_close(attn.weights, capped)


# ---------------------------------------------------------------------------------------------------------
# The Block's norms: named slots, nn.Identity where a placement has none (checkpoint keys depend on the names).
# ---------------------------------------------------------------------------------------------------------
NORM_SLOTS = ("self_attn_norm", "self_attn_out_norm", "self_attn_post_norm", "cross_attn_norm", "cross_attn_out_norm",
              "cross_attn_post_norm", "ffn_norm", "ffn_out_norm", "ffn_post_norm", "post_norm")
_PRE = {"self_attn_norm", "cross_attn_norm", "ffn_norm"}
# the real norms of a block with cross-attention; without it, the same less the cross_attn ones
LAYOUT = {
    ("post", "serial"): {"self_attn_post_norm", "cross_attn_post_norm", "ffn_post_norm"},
    ("post", "parallel"): {"post_norm"},
    ("pre", "serial"): _PRE,
    ("pre", "parallel"): _PRE,
    ("sandwich", "serial"): _PRE | {"self_attn_out_norm", "cross_attn_out_norm", "ffn_out_norm"},
    ("sandwich", "parallel"): _PRE | {"self_attn_out_norm", "cross_attn_out_norm", "ffn_out_norm"},
}


@pytest.mark.parametrize("norm_position,block", list(itertools.product(CHOICES["norm_position"], CHOICES["block"])))
@pytest.mark.parametrize("cross", [False, True])
def test_block_norms_have_names_and_unused_ones_are_identity(norm_position, block, cross):
    cfg = tiny(norm_position=norm_position, block=block, norm="rmsnorm")
    blk = Block(cfg, cross=cross)
    used = {name for name in NORM_SLOTS if not isinstance(getattr(blk, name), nn.Identity)}
    assert all(type(getattr(blk, name)).__name__ == "RMSNorm" for name in used)
    subs = {"self_attn", "ffn"} | ({"cross_attn"} if cross else set())
    assert {k.split(".")[0] for k in blk.state_dict()} == subs | used  # an Identity has no state-dict keys
    assert (blk.cross_attn is not None) == cross
    if (norm_position, block) in LAYOUT:  # a new placement is still built, trained and counted by the tests above
        want = {n for n in LAYOUT[norm_position, block] if cross or not n.startswith("cross_attn")}
        assert used == want


@pytest.mark.parametrize("block", CHOICES["block"])
def test_sandwich_norm_is_ding_2021(block):
    """Sandwich (CogView, arXiv:2105.13290, eq. 2): a norm before each sublayer and one on its output, the residual
    untouched: serial x1 = x + N1o(attn(N1(x))), x2 = x1 + N2o(ffn(N2(x1))); parallel x + N1o(attn(N1(x))) +
    N2o(ffn(N2(x))). The norms (jittered, each different) are applied here by hand as LayerNorms with their weights."""
    cfg = tiny(arch="decoder_only", norm_position="sandwich", block=block, position="rope")
    blk = jitter(Block(cfg)).eval()
    x = torch.randn(2, 5, cfg.d_model)  # (B, T, d)
    mask = Mask(causal=True)

    def ln(norm, h):
        return F.layer_norm(h, (cfg.d_model,), norm.weight, norm.bias, cfg.norm_eps)

    with torch.no_grad():
        a = ln(blk.self_attn_out_norm, blk.self_attn(ln(blk.self_attn_norm, x), mask))
        if block == "serial":
            x1 = x + a
            want = x1 + ln(blk.ffn_out_norm, blk.ffn(ln(blk.ffn_norm, x1)))
        else:
            want = x + a + ln(blk.ffn_out_norm, blk.ffn(ln(blk.ffn_norm, x)))
        torch.testing.assert_close(blk(x, mask), want, atol=1e-5, rtol=1e-5)


def test_position_none_carries_no_order():
    """position=none (no positional information at all): a bidirectional encoder is then permutation-equivariant,
    permuting the tokens permutes its outputs; with learned positions it is not."""
    ids, perm = tokens(2, 9, 3), torch.randperm(9, generator=torch.Generator().manual_seed(1))
    for position, equivariant in (("none", True), ("learned", False)):
        model = jitter(build_model(tiny(arch="encoder_only", position=position))).eval()
        with torch.no_grad():
            out, permuted = model(ids), model(ids[:, perm])  # (B, T, V) each
        assert torch.allclose(permuted, out[:, perm], atol=1e-5) == equivariant, position


def test_dropout_is_on_the_embeddings_and_each_sublayer_output():
    """dropout p: x0 = drop(embed + pos), then x = x + drop(f(norm(x))) per sublayer (pre-norm), each mask an
    inverted dropout (kept values scaled by 1 / (1 - p)); drawn here in the same order from the same seed."""
    cfg = tiny(arch="decoder_only", norm_position="pre", position="sinusoidal", dropout=0.3, scale_embeddings=True)
    model = jitter(build_model(cfg)).train()
    ids = tokens(2, 7)
    torch.manual_seed(5)
    got = model(ids, return_hidden=True)  # (B, T, d)
    dec = model.decoder
    with torch.no_grad():
        torch.manual_seed(5)
        x = F.dropout(dec.embed(ids) * math.sqrt(cfg.d_model) + dec.positions(0, 7, ids.device), 0.3)
        for blk in dec.layers:
            x = x + F.dropout(blk.self_attn(blk.self_attn_norm(x), Mask(causal=True)), 0.3)
            x = x + F.dropout(blk.ffn(blk.ffn_norm(x)), 0.3)
        want = dec.norm(x)
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, model.eval()(ids, return_hidden=True).detach(), atol=1e-3)


def test_attn_dropout_drops_attention_probabilities():
    """attn_dropout p (eager backend): softmax(q k^T / sqrt(hd)) -> inverted dropout -> @ v, drawn here from the same
    seed; the residual dropout is 0, so that mask is the only random draw."""
    cfg = tiny(arch="decoder_only", attn_dropout=0.4, attention_backend="eager", n_kv_heads=4)
    attn = jitter(Attention(cfg)).train()
    x = torch.randn(2, 6, cfg.d_model)  # (B, T, d)
    torch.manual_seed(9)
    got = attn(x, Mask(causal=True))
    with torch.no_grad():
        q, k, v = (t.view(2, 6, 4, 8).transpose(1, 2) for t in attn.qkv_proj(x).split(32, dim=-1))  # (B, H, T, hd)
        s = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
        torch.manual_seed(9)
        w = F.dropout(s.softmax(-1), 0.4)  # (B, H, T, T)
        want = attn.out_proj((w @ v).transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, attn.eval()(x, Mask(causal=True)).detach(), atol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# Accounting over the switches the forward grid only samples, component by component.
# ---------------------------------------------------------------------------------------------------------
def component(name: str) -> str:
    """The count_parameters key a parameter of the built model belongs to."""
    parts = name.split(".")
    if parts[0] == "head":
        return "head"
    stack = parts[0]
    if parts[1] == "embed":
        return "embeddings"
    if parts[1] in ("positions", "embed_norm"):
        return f"{stack}.{parts[1]}"
    if parts[1] == "norm":  # the final norm of a pre/sandwich stack
        return f"{stack}.norms"
    sub = parts[3]  # layers.<i>.<sub>: a sublayer, or one of the Block's norms (self_attn_norm, ..., post_norm)
    if sub.endswith("_norm"):
        return f"{stack}.norms"
    return f"{stack}." + {"self_attn": "self_attention", "cross_attn": "cross_attention", "ffn": "ffn"}[sub]


@pytest.mark.parametrize("arch", ARCHS)
def test_accounting_equals_the_built_model_component_by_component(arch):
    switches = itertools.cycle(itertools.product(CHOICES["norm"], CHOICES["ffn"], [False, True], [False, True],
                                                 [False, True], [False, True]))  # norm, ffn, 3 biases, embed_norm
    outer = list(itertools.product(CHOICES["norm_position"], CHOICES["block"], [False, True], [4, 2, 1],
                                   CHOICES["tie_embeddings"], [False, True]))
    n = 0
    for norm_position, block, qk_norm, n_kv, tie, learned in outer:
        norm, ffn, attn_bias, ffn_bias, norm_bias, embed_norm = next(switches)
        cfg = tiny(arch=arch, norm=norm, norm_position=norm_position, block=block, ffn=ffn, qk_norm=qk_norm,
                   n_kv_heads=n_kv, attn_bias=attn_bias, ffn_bias=ffn_bias, norm_bias=norm_bias, tie_embeddings=tie,
                   embed_norm=embed_norm,
                   position="learned" if learned else "rope", n_enc_layers=3, n_dec_layers=2,
                   src_vocab_size=29 if tie != "all" else 0, d_ff=48 if n % 2 else 0,
                   head_dim=12 if n % 3 == 1 else 0, v_head_dim=6 if n % 4 == 1 else 0)
        model = build_model(cfg)
        built: dict[str, int] = {}
        for name, p in model.named_parameters():  # a shared table is listed once
            built[component(name)] = built.get(component(name), 0) + p.numel()
        counts = count_parameters(cfg)
        assert counts.pop("total") == sum(built.values()), cfg
        assert {k: v for k, v in counts.items() if v} == built, cfg
        n += 1
    assert n == len(outer) >= 216


@pytest.mark.parametrize("padded", [False, True])
def test_flash_attn_with_qk_norm_under_bf16_autocast_gets_one_16bit_dtype(monkeypatch, padded):
    """Under autocast a norm's output is fp32 while the values are bf16; the kernel takes one 16-bit dtype, so
    q and k reach it in v's dtype. The stand-in refuses fp32 and mixed dtypes as the CUDA kernel does."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(half_only=True))
    cfg = tiny(qk_norm=True, norm="rmsnorm", norm_position="pre", attention_backend="flash_attn")
    torch.manual_seed(0)
    model = jitter(build_model(cfg), 0).eval()
    src, tgt = tokens(2, 7, 1), tokens(2, 6, 2)
    if padded:
        src[1, 4:] = 0  # the varlen path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(src, tgt).float()  # (B, T, V)
    set_backend(model, "sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(src, tgt).float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # bf16 on both sides


def test_flash_attn_varlen_makes_one_sync_per_forward_not_one_per_layer(monkeypatch):
    """The unpadding index is built once from the shared mask (one read-back of the kept count); the kernel's
    max_seqlen_k is the padded length, so no layer reads the lengths back. (A silent kernel: the stand-in's own
    checks read tensors back.)"""
    quiet = types.ModuleType("flash_attn")
    quiet.flash_attn_func = lambda q, k, v, **kw: torch.zeros_like(q)
    quiet.flash_attn_varlen_func = lambda q, k, v, *args, **kw: torch.zeros_like(q)
    monkeypatch.setitem(sys.modules, "flash_attn", quiet)
    cfg = tiny(attention_backend="flash_attn", n_enc_layers=3)
    model = build_model(cfg).eval()
    src = tokens(2, 7, 1)
    src[1, 4:] = 0
    with DispatchCount() as c:
        model.encode(src)
    assert c.syncs == 1, c.sync_ops


def spy_sdpa(monkeypatch) -> list[dict]:
    """Record the arguments of every F.scaled_dot_product_attention call attnlab makes."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "is_causal": is_causal, "gqa": kw.get("enable_gqa", False),
                      "heads": (q.shape[1], k.shape[1]), "Tq": q.shape[2]})
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return calls


def test_sdpa_gets_no_mask_without_padding_is_causal_in_the_decoder_and_enable_gqa(monkeypatch):
    """What lets SDPA pick its flash kernel: no attn_mask when the batch has no padding (encoder and
    cross-attention), is_causal=True for decoder self-attention, K/V heads never repeated (enable_gqa). With
    padding the encoder and cross-attention get their mask, and both ways give the same outputs."""
    cfg = tiny()  # 4 query heads, 2 K/V heads
    model = jitter(build_model(cfg), 0).eval()
    src, tgt = tokens(2, 7, 1), tokens(2, 6, 2)
    calls = spy_sdpa(monkeypatch)
    no_mask = model(src, tgt, src_padded=False)  # (B, T, V)
    assert len(calls) == 2 + 2 * 2  # encoder self, decoder self + cross, per layer
    assert all(c["mask"] is None and c["gqa"] and c["heads"] == (4, 2) for c in calls), calls
    assert sum(c["is_causal"] for c in calls) == 2  # decoder self-attention
    calls.clear()
    torch.testing.assert_close(model(src, tgt), no_mask, rtol=1e-6, atol=1e-6)  # a mask with nothing hidden
    assert sum(c["mask"] is not None for c in calls) == 4 and sum(c["is_causal"] for c in calls) == 2
    for arch, kw in (("decoder_only", {}), ("encoder_only", {"padded": False})):
        calls.clear()
        one = jitter(build_model(tiny(arch=arch)), 0).eval()
        one(tgt, **kw)
        assert all(c["mask"] is None and c["gqa"] and c["is_causal"] == (arch == "decoder_only") for c in calls)


def test_sdpa_off_the_cpu_runs_without_the_cudnn_kernel(monkeypatch):
    """Off the CPU (meta tensors stand in for CUDA ones here) SDPA is called with its cuDNN kernel switched off:
    cuDNN builds a plan per new shape (~0.4 s on an H100), and token-count batches bring a new shape nearly every
    step. The flash and memory-efficient kernels stay allowed, and the CPU path is left as it is."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.device.type, torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    attn = Attention(tiny()).eval()
    for device in ("cpu", "meta"):
        x = torch.randn(2, 5, attn.qkv_proj.in_features)  # (B, T, d)
        attn.to(device)(x.to(device), Mask(causal=True))
    assert seen == [("cpu", True, True, True), ("meta", False, True, True)], seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # switched off only around the call
