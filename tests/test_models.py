"""The whole variant grid: builds, trains (finite grads everywhere), KV cache == full forward,
causality, padding invariance, sdpa == eager, accounting == built model."""

import itertools

import pytest
import torch

from attnlab.config import ModelConfig
from attnlab.models import build_model
from attnlab.models.accounting import count_parameters

ARCHS = ["encoder_decoder", "decoder_only", "encoder_only"]
GRID = list(itertools.product(ARCHS, ["layernorm", "rmsnorm"], ["post", "pre", "sandwich"], ["serial", "parallel"],
                              ["sinusoidal", "learned", "rope", "alibi", "none"]))
INNER = list(itertools.product(["relu", "gelu", "reglu", "geglu", "swiglu"], [False, True]))
V = 37


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


@pytest.mark.parametrize("arch,norm,norm_position,block,position", GRID)
def test_variant_grid(arch, norm, norm_position, block, position):
    torch.manual_seed(0)
    src, tgt = tokens(2, 7, 1), tokens(2, 6, 2)
    src[1, 5:] = 0  # real padding in the source
    for ffn, qk_norm in INNER:
        cfg = tiny(arch=arch, norm=norm, norm_position=norm_position, block=block, position=position, ffn=ffn,
                   qk_norm=qk_norm, dropout=0.1, attn_dropout=0.1)
        model = build_model(cfg)
        # exact accounting, from the config alone
        assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters())
        # forward + backward in train mode; every parameter gets a finite gradient
        out = run(model, cfg, src, tgt)
        assert out.shape == (2, src.shape[1] if arch == "encoder_only" else tgt.shape[1], V)
        out.float().pow(2).mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{cfg}: {name} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        # sdpa and eager agree (eval mode: no dropout)
        model.eval()
        with torch.no_grad():
            ref = run(model, cfg, src, tgt)
            eager = build_model(cfg.replace(attention_backend="eager"))
            eager.load_state_dict(model.state_dict())
            eager.eval()
            torch.testing.assert_close(run(eager, cfg, src, tgt), ref, atol=1e-5, rtol=1e-4)
            if arch != "encoder_only":
                check_cache(model, cfg, src, tgt, ref)


def check_cache(model, cfg, src, tgt, full):
    """Incremental decoding over the KV cache gives the full forward's logits: a prefix chunk, then
    single tokens, then a chunk after a cached prefix (the bottom-right causal mask)."""
    cache = model.new_cache()
    if cfg.arch == "encoder_decoder":
        memory, src_pad = model.encode(src)
        step = lambda ids: model.decode(ids, memory, src_pad, cache=cache)  # noqa: E731
    else:
        step = lambda ids: model(ids, cache=cache)  # noqa: E731
    pieces = [step(tgt[:, :2]), step(tgt[:, 2:3]), step(tgt[:, 3:4]), step(tgt[:, 4:6])]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.pos == tgt.shape[1]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "alibi", "none"])
def test_causality(arch, position):
    """Changing a future token never changes an earlier output."""
    torch.manual_seed(0)
    cfg = tiny(arch=arch, position=position, norm_position="pre")
    model = build_model(cfg).eval()
    src, tgt = tokens(2, 8, 3), tokens(2, 9, 4)
    base = run(model, cfg, src, tgt)
    for t in range(tgt.shape[1]):
        changed = tgt.clone()
        changed[:, t] = (changed[:, t] + 1 - 4) % (V - 4) + 4
        out = run(model, cfg, src, changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(out[:, t:], base[:, t:])  # the change is visible from position t on


@pytest.mark.parametrize("arch", ["encoder_decoder", "encoder_only"])
@pytest.mark.parametrize("position", ["sinusoidal", "rope", "alibi"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_padding_never_changes_real_outputs(arch, position, backend):
    """A sentence batched with a longer one (so padded) gives the outputs it gives alone,
    through the encoder's self-attention and the decoder's cross-attention."""
    torch.manual_seed(0)
    cfg = tiny(arch=arch, position=position, attention_backend=backend)
    model = build_model(cfg).eval()
    short, long_ = tokens(1, 5, 5), tokens(1, 9, 6)
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, :5], batch[1] = short[0], long_[0]
    tgt = tokens(2, 4, 7)
    if arch == "encoder_decoder":
        alone, batched = model(short, tgt[:1]), model(batch, tgt)
        torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(batched[1], model(long_, tgt[1:])[0], atol=1e-5, rtol=1e-4)
    else:
        alone, batched = model(short), model(batch)
        torch.testing.assert_close(batched[0, :5], alone[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_mha_gqa_mqa_share_kv_heads(n_kv_heads):
    cfg = tiny(arch="decoder_only", n_heads=4, n_kv_heads=n_kv_heads, position="rope")
    model = build_model(cfg)
    qkv = model.decoder.layers[0].self_attn.qkv_proj
    assert qkv.out_features == (4 + 2 * n_kv_heads) * cfg.head_dim
    model.eval()
    ids = tokens(2, 6)
    eager = build_model(cfg.replace(attention_backend="eager")).eval()
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(ids), eager(ids), atol=1e-5, rtol=1e-4)


def test_tied_embeddings_share_one_table():
    m = build_model(tiny(tie_embeddings="all"))
    assert m.encoder.embed is m.decoder.embed and m.head is None
    m = build_model(tiny(tie_embeddings="decoder", src_vocab_size=20))
    assert m.encoder.embed is not m.decoder.embed and m.head is None and m.encoder.embed.num_embeddings == 20
    m = build_model(tiny(tie_embeddings="none"))
    assert m.head is not None and m.head.weight is not m.decoder.embed.weight


def test_logit_softcap_bounds_logits():
    cfg = tiny(arch="decoder_only", logit_softcap=2.0)
    model = build_model(cfg)
    with torch.no_grad():
        model.decoder.embed.weight.mul_(100)
    out = model(tokens(2, 5))
    assert out.abs().max() <= 2.0
    plain = build_model(cfg.replace(logit_softcap=0.0))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, 2.0 * torch.tanh(plain(tokens(2, 5)) / 2.0))


def test_attn_softcap_matches_formula():
    """Gemma 2: scores = c * tanh(scores / c) before the softmax."""
    torch.manual_seed(0)
    cfg = tiny(arch="decoder_only", attn_softcap=0.5, attention_backend="eager", n_dec_layers=1)
    model = build_model(cfg).eval()
    attn = model.decoder.layers[0].self_attn
    attn.keep_weights = True
    model(tokens(1, 6))
    w = attn.weights  # (1, H, 6, 6)
    assert w.shape == (1, 4, 6, 6)
    # with scores capped to (-c, c), no weight in a row of n visible keys can exceed e^(2c) / (e^(2c) + n - 1)
    n = torch.arange(1, 7).float()
    bound = torch.exp(torch.tensor(1.0)) / (torch.exp(torch.tensor(1.0)) + n - 1)
    assert (w[0].max(-1).values <= bound + 1e-6).all()
    uncapped = build_model(cfg.replace(attn_softcap=0.0)).eval()
    uncapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        uncapped.decoder.layers[0].self_attn.qkv_proj.weight.mul_(30)  # large scores: uncapped peaks
        model.decoder.layers[0].self_attn.qkv_proj.weight.mul_(30)
    uncapped.decoder.layers[0].self_attn.keep_weights = True
    uncapped(tokens(1, 6))
    model(tokens(1, 6))
    assert (attn.weights[0].max(-1).values <= bound + 1e-6).all()
    assert (uncapped.decoder.layers[0].self_attn.weights[0].max(-1).values > bound + 1e-3).any()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 6))
