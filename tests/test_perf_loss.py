"""The chunked linear cross-entropy (trainer.loss_chunk) against the plain token_loss: losses and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.config import ConfigError, ModelConfig
from attnlab.data.config import DataConfig
from attnlab.experiment import Experiment, TrainConfig
from attnlab.lit import LMModule, Seq2SeqModule
from attnlab.lit.loss import linear_cross_entropy, token_loss
from attnlab.train import make_module

PAD = 0


def plain(h, w, t, smoothing, z_loss, softcap):
    logits = h @ w.t()  # (N, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return token_loss(logits, t, PAD, smoothing, z_loss)


@pytest.mark.parametrize("smoothing,z_loss,softcap", [(0.0, 0.0, 0.0), (0.1, 0.0, 0.0), (0.1, 1e-2, 0.0),
                                                     (0.2, 1e-3, 3.0)])
@pytest.mark.parametrize("chunk", [7, 64])  # 7 does not divide the 45 tokens; 64 holds them all
def test_loss_and_gradients_equal_the_plain_path(smoothing, z_loss, softcap, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 15, 16, generator=g, requires_grad=True)  # (B, T, d)
    w = (torch.randn(50, 16, generator=g) * 0.5).requires_grad_()  # (V, d)
    t = torch.randint(1, 50, (3, 15), generator=g)
    t[0, 10:] = PAD
    t[2, 3] = PAD
    want = plain(h.reshape(-1, 16), w, t.reshape(-1), smoothing, z_loss, softcap)
    got = linear_cross_entropy(h, w, t, PAD, smoothing, z_loss, softcap, chunk=chunk)
    assert int(got[2]) == int(want[2]) == 45 - 6
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    scale = 0.37  # a loss scaled after the fact (divided by the tokens, say) scales the gradients
    want_g = torch.autograd.grad(want[0] * scale, (h, w))
    got_g = torch.autograd.grad(got[0] * scale, (h, w))
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_gradients_are_computed_without_autograd_and_bad_arguments_fail():
    h, w = torch.randn(10, 8), torch.randn(20, 8)
    t = torch.randint(1, 20, (10,))
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, PAD, 0.1, chunk=3)
    assert not got[0].requires_grad
    torch.testing.assert_close(got[0], plain(h, w, t, 0.1, 0.0, 0.0)[0])
    with pytest.raises(ValueError, match="chunk=0"):
        linear_cross_entropy(h, w, t, PAD, chunk=0)
    with pytest.raises(ValueError, match="10 tokens but target has 9"):
        linear_cross_entropy(h, w, t[:9], PAD)


def test_under_bf16_autocast_it_matches_the_plain_path_and_keeps_fp32_gradients():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = (torch.randn(64, 32, generator=g) * 0.3).requires_grad_()
    t = torch.randint(1, 64, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = token_loss(F.linear(h, w), t, PAD, 0.1)[0]  # bf16 logits, fp32 loss: the model's own path
        got = linear_cross_entropy(h, w, t, PAD, 0.1, chunk=16)[0]
    gw, gh = torch.autograd.grad(want, (w, h)), torch.autograd.grad(got, (w, h))
    assert gh[0].dtype == gh[1].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)
    for a, b in zip(gh, gw, strict=True):
        assert (a - b).abs().max() < 0.02 * b.abs().max()  # bf16 matmuls on both sides


def tiny_model(arch: str, **kw) -> dict:
    base = dict(arch=arch, vocab_size=60, d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=2, dropout=0.0)
    return ModelConfig(**{**base, **kw}).to_dict()


@pytest.mark.parametrize("module,arch,kw", [
    (Seq2SeqModule, "encoder_decoder", {"tie_embeddings": "all", "z_loss": 1e-3}),
    (LMModule, "decoder_only", {"tie_embeddings": "none", "logit_softcap": 4.0, "position": "rope"}),
])
def test_training_step_with_loss_chunk_equals_the_plain_step(module, arch, kw, monkeypatch):
    """The whole training_step (model, output weight, tied or not, loss): same loss, same parameter gradients."""
    monkeypatch.setattr(module, "log_train_step", lambda self, *a: None)  # logging needs a Trainer
    g = torch.Generator().manual_seed(2)
    if arch == "encoder_decoder":
        batch = {"src": torch.randint(3, 60, (4, 9), generator=g), "tgt_in": torch.randint(3, 60, (4, 7), generator=g),
                 "tgt_out": torch.randint(3, 60, (4, 7), generator=g)}
        batch["tgt_out"][1, 4:] = PAD
    else:
        batch = {"input": torch.randint(3, 60, (3, 11), generator=g),
                 "target": torch.randint(3, 60, (3, 11), generator=g)}
    optim = {"label_smoothing": 0.1}
    results = []
    for chunk in (0, 5):
        torch.manual_seed(0)
        m = module(model=tiny_model(arch, **kw), optim=optim, loss_chunk=chunk).train()
        loss = m.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_loss_chunk_reaches_the_module_and_leaves_the_run_identity_alone():
    data = DataConfig()
    exp = Experiment(name="t", model=ModelConfig(**tiny_model("decoder_only")), data=data)
    chunked = exp.replace(trainer=TrainConfig(loss_chunk=256))
    assert make_module(chunked).loss_chunk == 256 and make_module(exp).loss_chunk == 0
    assert chunked.config_hash() == exp.config_hash()  # the same loss, so the same run
    with pytest.raises(ConfigError, match="trainer.loss_chunk=-1"):
        TrainConfig(loss_chunk=-1)
    with pytest.raises(ConfigError, match="fsdp"):
        TrainConfig(loss_chunk=64, strategy="fsdp")
