"""Positions, norms, FFNs and accounting against their papers' formulas and textbook counts; bad input is a clear
error. The norms and FFNs are read from `attnlab.config.CHOICES`: a new table entry is tested here unedited."""

import math
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnlab.config import CHOICES, ModelConfig
from attnlab.models.accounting import (
    count_parameters,
    ffn_params,
    flops_per_token,
    layer_parameters,
    norm_params,
    training_flops,
)
from attnlab.models.layers import (
    FeedForward,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    make_norm,
    rope_cos_sin,
    sinusoidal_positions,
)
from attnlab.models.tables import ACTIVATIONS, RMSNorm
from attnlab.models.transformer import build_model
from dispatch_count import DispatchCount


def test_sinusoidal_matches_the_paper_formula():
    d, T = 16, 50
    pe = sinusoidal_positions(torch.arange(T), d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert math.isclose(pe[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(pe[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-5)


def test_alibi_slopes_match_the_paper():
    # Press et al. 2022, section 3: 8 heads -> 1/2^1 ... 1/2^8
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    # 16 heads start at 1/sqrt(2) and multiply by it
    assert torch.allclose(alibi_slopes(16), torch.tensor([2.0 ** (-0.5 * i) for i in range(1, 17)]))
    # 12 heads (not a power of two): the 8-head slopes, then every other slope of 16 heads
    expected = [2.0**-i for i in range(1, 9)] + [2.0 ** (-0.5 * i) for i in range(1, 17)][0::2][:4]
    assert torch.allclose(alibi_slopes(12), torch.tensor(expected))
    b = alibi_bias(alibi_slopes(2), torch.arange(3), torch.arange(3))  # (2, 3, 3)
    assert b[0, 2, 0] == -alibi_slopes(2)[0] * 2 and b[1, 1, 1] == 0 and b[0, 0, 2] == b[0, 2, 0]


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), 8, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([n]), 8, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert math.isclose(score(3, 1), score(10, 8), rel_tol=1e-5)
    assert math.isclose(score(0, 0), (q * k).sum().item(), rel_tol=1e-5)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)
    # partial rotary: the dims past the rotary width pass through unchanged
    c, s = rope_cos_sin(torch.tensor([5]), 4, 10000.0)
    out = apply_rope(q, c, s)
    assert torch.equal(out[..., 4:], q[..., 4:]) and not torch.allclose(out[..., :4], q[..., :4])


def test_rmsnorm_matches_formula():
    """y = g * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019, eq. 4), with a gain g far from 1."""
    x = torch.randn(3, 8)
    n = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.linspace(-2.0, 3.0, 8))
    want = torch.linspace(-2.0, 3.0, 8) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(n(x), want)
    assert not torch.allclose(n(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=0.1)


@pytest.mark.parametrize("norm", CHOICES["norm"])
@pytest.mark.parametrize("bias", [False, True])
def test_every_norm_choice_builds_and_is_counted(norm, bias):
    cfg = ModelConfig(d_model=16, n_heads=2, norm=norm, norm_bias=bias, norm_eps=1e-6)
    n = make_norm(cfg)
    x = torch.randn(3, 5, 16)  # (B, T, d)
    assert n(x).shape == x.shape
    assert sum(p.numel() for p in n.parameters()) == norm_params(cfg)
    assert sum(p.numel() for p in make_norm(cfg, 4).parameters()) == norm_params(cfg, 4)  # a QK-norm's head width


# Known activations against their definitions; a new table entry is checked against its table function only.
ACTIVATION_FORMULAS = {
    "relu": lambda x: x.clamp(min=0),  # max(0, x)
    "gelu": lambda x: x * 0.5 * (1 + torch.erf(x / math.sqrt(2))),  # x * Phi(x), the exact form
    "reglu": lambda x: x.clamp(min=0),
    "geglu": lambda x: x * 0.5 * (1 + torch.erf(x / math.sqrt(2))),
    "swiglu": lambda x: x * torch.sigmoid(x),  # Swish_1 = SiLU
}


@pytest.mark.parametrize("ffn", CHOICES["ffn"])
def test_every_ffn_choice_computes_its_formula_and_is_counted(ffn):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=24, n_heads=2, ffn=ffn, ffn_multiple_of=8)
    act = ACTIVATION_FORMULAS.get(ffn, ACTIVATIONS[ffn].fn)
    m = FeedForward(cfg)
    x = torch.randn(2, 3, 24)  # (B, T, d)
    h = F.linear(x, m.fc1.weight, m.fc1.bias)  # (B, T, ff), or (B, T, 2 ff) when gated
    if cfg.gated:  # act(x W_gate) * (x W_up), Shazeer 2020
        gate, up = h.split(cfg.ffn_dim, dim=-1)  # (B, T, ff) each
        h = act(gate) * up
    else:
        h = act(h)
    torch.testing.assert_close(m(x), F.linear(h, m.fc2.weight, m.fc2.bias))
    assert m.fc2.in_features == cfg.ffn_dim == (64 if cfg.gated else 96)  # 8/3 d rounded up to 8, or 4 d
    assert sum(p.numel() for p in m.parameters()) == ffn_params(cfg)


def glu_by_hand(x, w_gate, b_gate, w_up, b_up, w2, b2, act):
    """FFN_GLU-variant(x) = (act(x W + b) * (x V + c)) W2 + b2, element by element (Shazeer 2020, eqs. 5-6)."""
    out = torch.zeros(x.shape[0], w2.shape[0], dtype=torch.float64)
    for n in range(x.shape[0]):
        for j in range(w_gate.shape[0]):
            gate = act(float(x[n] @ w_gate[j] + b_gate[j]))
            up = float(x[n] @ w_up[j] + b_up[j])
            out[n] += gate * up * w2[:, j].double()
    return out + b2.double()  # (N, d)


@pytest.mark.parametrize("ffn,act", [("reglu", lambda v: max(0.0, v)),
                                     ("geglu", lambda v: v * 0.5 * (1 + math.erf(v / math.sqrt(2))))])
def test_reglu_and_geglu_against_shazeer_2020(ffn, act):
    """Gate and up projections drawn separately, with biases, and put into the fused fc1 as [gate; up]; swapping the
    halves gives another function (so the test pins which half is the gate)."""
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(d_model=8, n_heads=2, ffn=ffn, d_ff=6)
    m = FeedForward(cfg)
    w_gate, w_up, w2 = (torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(8, 6, generator=g))
    b_gate, b_up, b2 = torch.randn(6, generator=g), torch.randn(6, generator=g), torch.randn(8, generator=g)
    with torch.no_grad():
        m.fc1.weight.copy_(torch.cat((w_gate, w_up)))
        m.fc1.bias.copy_(torch.cat((b_gate, b_up)))
        m.fc2.weight.copy_(w2)
        m.fc2.bias.copy_(b2)
    x = torch.randn(5, 8, generator=g)
    want = glu_by_hand(x, w_gate, b_gate, w_up, b_up, w2, b2, act)
    torch.testing.assert_close(m(x).double(), want, atol=1e-4, rtol=1e-5)
    swapped = glu_by_hand(x, w_up, b_up, w_gate, b_gate, w2, b2, act)
    assert not torch.allclose(swapped, want, atol=1e-2)


@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_xavier_init_standard_deviations(n_kv_heads):
    """init=xavier (fairseq): each projection U(-a, a), a = sqrt(6 / (fan_in + fan_out)), so std sqrt(2 / (fan_in +
    fan_out)), a fused projection's parts each with their own fan_out; biases 0; embeddings N(0, d^-1/2)."""
    torch.manual_seed(0)
    d, ff = 256, 512
    cfg = ModelConfig(vocab_size=2000, d_model=d, n_heads=8, n_kv_heads=n_kv_heads, n_enc_layers=1, n_dec_layers=1,
                      d_ff=ff, ffn="swiglu", tie_embeddings="none")
    model = build_model(cfg)
    blk = model.decoder.layers[0]
    kv = n_kv_heads * d // 8
    q, k, v = blk.self_attn.qkv_proj.weight.split([d, kv, kv])
    ck, cv = blk.cross_attn.kv_proj.weight.split([kv, kv])
    gate, up = blk.ffn.fc1.weight.split([ff, ff])
    for w, fan_in, fan_out in [(q, d, d), (k, d, kv), (v, d, kv), (ck, d, kv), (cv, d, kv), (gate, d, ff),
                               (up, d, ff), (blk.ffn.fc2.weight, ff, d), (blk.self_attn.out_proj.weight, d, d),
                               (model.head.weight, d, 2000)]:
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)
    assert all(not b.any() for name, b in model.named_parameters() if name.endswith("proj.bias"))
    assert model.decoder.embed.weight.std().item() == pytest.approx(d**-0.5, rel=0.03)


def test_normal_init_scales_the_residual_projections_by_depth():
    """init=normal (GPT-2, Radford et al. 2019, section 2.3): N(0, init_std) everywhere, the projections into the
    residual stream (attention output, fc2) N(0, init_std / sqrt(2 * layers)); biases 0."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder_only", vocab_size=4000, d_model=256, n_heads=8, n_dec_layers=8, init="normal",
                      init_std=0.05, position="rope", norm_position="pre")
    model = build_model(cfg)
    blk = model.decoder.layers[3]
    for w, std in [(blk.self_attn.qkv_proj.weight, 0.05), (blk.ffn.fc1.weight, 0.05),
                   (model.decoder.embed.weight, 0.05), (blk.self_attn.out_proj.weight, 0.05 / 4),
                   (blk.ffn.fc2.weight, 0.05 / 4)]:
        assert w.mean().abs() < 0.05 * std and w.std().item() == pytest.approx(std, rel=0.03)
    assert not blk.ffn.fc1.bias.any() and not blk.self_attn.out_proj.bias.any()


def test_bert_base_layer_is_7087872_parameters_as_in_transformers():
    """BERT-base's layer has biases on its attention projections and FFN (Devlin et al. 2019)."""
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(arch="encoder_only", d_model=768, n_heads=12, d_ff=3072, ffn="gelu", attn_bias=True,
                      ffn_bias=True, norm="layernorm", vocab_size=30522)
    bert = transformers.models.bert.modeling_bert.BertLayer(transformers.BertConfig())
    assert layer_parameters(cfg) == sum(p.numel() for p in bert.parameters()) == 7_087_872
    # without the attention's 4 x 768 biases
    assert layer_parameters(cfg.replace(attn_bias=False)) == 7_087_872 - 4 * 768


def test_base_and_big_transformer_counts():
    base = count_parameters(ModelConfig(vocab_size=37000))
    # shared 37k table + 6 encoder layers (3,152,384 each) + 6 decoder layers (4,204,032 each)
    assert base["embeddings"] == 37000 * 512
    assert base["encoder.self_attention"] == 6 * (4 * 512 * 512 + 4 * 512)
    assert base["total"] == 37000 * 512 + 6 * 3_152_384 + 6 * 4_204_032
    big = count_parameters(ModelConfig(vocab_size=37000, d_model=1024, n_heads=16, d_ff=4096))
    attention, ffn, norm = 4 * 1024 * 1024 + 4 * 1024, 2 * 1024 * 4096 + 4096 + 1024, 2 * 1024
    encoder_layer, decoder_layer = attention + ffn + 2 * norm, 2 * attention + ffn + 3 * norm
    assert (encoder_layer, decoder_layer) == (12_596_224, 16_796_672)
    assert big["total"] == 37000 * 1024 + 6 * encoder_layer + 6 * decoder_layer == 214_245_376


def test_accounting_scales_instantly_to_billions():
    cfg = ModelConfig(arch="decoder_only", vocab_size=128256, d_model=8192, n_heads=64, n_kv_heads=8,
                      n_dec_layers=80, d_ff=28672, ffn="swiglu", norm="rmsnorm", norm_position="pre",
                      position="rope", attn_bias=False, ffn_bias=False, tie_embeddings="none")
    t = time.perf_counter()
    n = count_parameters(cfg)["total"]
    assert time.perf_counter() - t < 0.1
    assert n == 70_553_706_496  # Llama-3-70B's published size (70.6B)


def test_flops_are_6n_plus_attention():
    cfg = ModelConfig(arch="decoder_only", vocab_size=1000, d_model=64, n_heads=4, n_dec_layers=2,
                      position="rope", norm_position="pre", tie_embeddings="none")
    n = count_parameters(cfg)
    non_embedding = n["total"] - n["embeddings"]  # the head is a matmul and counts
    T = 128
    assert flops_per_token(cfg, T) == pytest.approx(6 * non_embedding + 12 * 2 * 64 * T)
    with_norm = cfg.replace(embed_norm=True)  # one more LayerNorm (2 x 64 parameters), 6 FLOPs each a token
    assert flops_per_token(with_norm, T) == pytest.approx(flops_per_token(cfg, T) + 6 * 128)
    ed = ModelConfig(vocab_size=1000, d_model=64, n_heads=4, n_enc_layers=1, n_dec_layers=1)
    f = training_flops(ed, seq_len=10, src_len=30)
    assert f["encoder.attention"] == 12 * 64 * 30 * 30 and f["decoder.cross_attention"] == 12 * 64 * 10 * 30
    assert f["per_token"] == f["total"] / 10
    # d_k apart from d_v: scores cost 2 d_k and the weighted values 2 d_v per key and head, forward (x 3 training)
    kv = training_flops(ed.replace(head_dim=8, v_head_dim=32), seq_len=10, src_len=30)
    assert kv["encoder.attention"] == 6 * 4 * (8 + 32) * 30 * 30 and kv["decoder.attention"] == 6 * 4 * 40 * 10 * 10


def test_token_ids_outside_the_vocabulary_are_a_clear_error():
    model = build_model(ModelConfig(vocab_size=10, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1))
    ok = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"source token id 10 is outside the vocabulary \[0, 10\)"):
        model(torch.tensor([[1, 10]]), ok)
    with pytest.raises(ValueError, match="target token id -1"):
        model(ok, torch.tensor([[1, -1]]))
    with pytest.raises(TypeError, match="int64 or int32"):
        model(ok.float(), ok)
    with pytest.raises(ValueError, match=r"shape \(batch, length\)"):
        model(ok[0], ok)
    # a source vocabulary of its own is named as the field it comes from
    model = build_model(ModelConfig(vocab_size=30, src_vocab_size=20, tie_embeddings="none", d_model=16, n_heads=2,
                                    n_enc_layers=1, n_dec_layers=1))
    with pytest.raises(ValueError, match=r"source token id 25 is outside the vocabulary \[0, 20\) \(model\.src_vocab"):
        model(torch.tensor([[1, 25]]), ok)
    with pytest.raises(ValueError, match=r"target token id 30 is outside the vocabulary \[0, 30\) \(model\.vocab_size"):
        model(ok, torch.tensor([[1, 30]]))


def test_eager_attention_gives_a_row_of_padding_zero_output_and_zero_gradient():
    """A row whose keys are all padding: zeros out, as SDPA gives, and finite gradients, also with ALiBi's additive
    bias (a softmax over -inf everywhere is NaN, and its gradient reached the weights)."""
    for position in ("alibi", "sinusoidal"):
        for backend in ("eager", "sdpa"):
            torch.manual_seed(0)
            model = build_model(ModelConfig(arch="encoder_only", vocab_size=20, d_model=16, n_heads=2, n_enc_layers=1,
                                            dropout=0.0, position=position, attention_backend=backend))
            out = model(torch.tensor([[5, 6, 7], [0, 0, 0]]))  # (2, 3, V): the second row only padding (pad_id 0)
            out.pow(2).mean().backward()
            assert torch.isfinite(out).all(), (position, backend)
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            assert not bad, (position, backend, bad)



def test_checking_token_ids_reads_nothing_back_from_the_device():
    """The range check is an asynchronous assert: a forward with valid ids makes no device-to-host sync."""
    model = build_model(ModelConfig(vocab_size=10, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1))
    ok = torch.ones(2, 3, dtype=torch.long)
    with DispatchCount() as c:
        model(ok, ok)
    assert c.syncs == 0, c.sync_ops
    assert c.ops["aten::_assert_async"] == 2  # source and target checked

def test_sequence_longer_than_learned_table_is_a_clear_error():
    cfg = ModelConfig(arch="decoder_only", vocab_size=10, d_model=16, n_heads=2, n_dec_layers=1,
                      position="learned", max_seq_len=8)
    model = build_model(cfg)
    model(torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"9 positions.*model.max_seq_len=8"):
        model(torch.ones(1, 9, dtype=torch.long))


def test_flash_attn_backend_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails even where it is installed
    cfg = ModelConfig(vocab_size=10, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1,
                      attention_backend="flash_attn")
    with pytest.raises(ImportError, match=r"attnlab\[flash\]"):
        build_model(cfg)


def test_flash_attn_softcap_needs_flash_attn_2_6(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.5.9"))
    cfg = ModelConfig(arch="decoder_only", vocab_size=10, d_model=16, n_heads=2, n_dec_layers=1,
                      attention_backend="flash_attn")
    build_model(cfg)  # no soft-capping: 2.5 is enough
    with pytest.raises(ImportError, match=r"attn_softcap.*flash-attn >= 2\.6 \(installed: 2\.5\.9\)"):
        build_model(cfg.replace(attn_softcap=30.0))
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.6.3"))
    build_model(cfg.replace(attn_softcap=30.0))


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_training_flops_equal_torchs_flop_counter_on_eager_attention(arch):
    """accounting.training_flops against torch.utils.flop_counter.FlopCounterMode over one forward and backward
    (eager attention: the full T x T score matrix, as the count assumes), GQA and a gated FFN included. The count
    also charges 6 FLOPs per norm gain and bias, which the counter (matmuls only) leaves out: within 1%."""
    cfg = ModelConfig(arch=arch, vocab_size=500, d_model=128, n_heads=4, n_kv_heads=2, n_enc_layers=2, n_dec_layers=2,
                      ffn="swiglu", attention_backend="eager", dropout=0.0, max_seq_len=64)
    model = build_model(cfg)
    B, S, T = 2, 40, 48  # long enough that attention weighs: half its count fails
    src, tgt = torch.randint(4, 500, (B, S)), torch.randint(4, 500, (B, T))
    with FlopCounterMode(display=False) as counter:
        out = model(src, tgt) if arch == "encoder_decoder" else model(tgt)  # (B, T, V)
        out.float().sum().backward()
    want = B * training_flops(cfg, T, S if arch == "encoder_decoder" else None)["total"]
    assert counter.get_total_flops() == pytest.approx(want, rel=0.01)
