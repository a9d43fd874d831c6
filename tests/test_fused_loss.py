"""trainer.fused_loss (lit/fused_loss.py): the option's checks and dispatch, and Liger Kernel's fused linear
cross-entropy against token_loss on the CPU, its Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1).

What the interpreter cannot run (checked with triton 3.7.1 and 3.9.0, liger-kernel 0.8.5, cut-cross-entropy 25.1.1):
liger's soft-capping (the kernel's float argument `softcap` reaches it as a Python float, and the interpreter has no
`libdevice.tanh`: "extern_elementwise not supported in interpreter mode"), and every CCE kernel (its log-sum-exp
uses `libdevice.log1p`). Those parities are tests/test_gpu.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.config import ConfigError, ModelConfig
from attnlab.data.config import DataConfig
from attnlab.experiment import Experiment, OptimConfig, TrainConfig
from attnlab.lit import LMModule, Seq2SeqModule
from attnlab.lit import base as lit_base
from attnlab.lit import fused_loss as fl
from attnlab.lit.loss import token_loss
from attnlab.train import check_extras, make_module

PAD = 0


def test_liger_matches_the_plain_path_under_the_triton_interpreter():
    """The parity checks below, in a process started with TRITON_INTERPRET=1: Triton reads it when a kernel is
    decorated, and triton.language's own helpers (tl.sum, tl.max, ...) are decorated when triton is imported, which
    torch._dynamo does in this process long before any test runs."""
    if sys.platform != "linux":
        pytest.skip("triton (liger's kernels) has Linux wheels only")  # there the dev extra installs both
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["liger-parity-ok"] * 3, run.stdout + run.stderr


def plain(h, w, t, smoothing, z_loss):
    return token_loss(h @ w.t(), t, PAD, smoothing, z_loss)  # (N, V) logits


def check_loss_and_gradients(smoothing: float, z_loss: float) -> None:
    """45 tokens, 6 of them padding, V 50, d 16: in liger's chunks of 32 tokens (the last one short)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 15, 16, generator=g, requires_grad=True)  # (B, T, d)
    w = (torch.randn(50, 16, generator=g) * 0.5).requires_grad_()  # (V, d)
    t = torch.randint(1, 50, (3, 15), generator=g)  # (B, T)
    t[0, 10:] = PAD
    t[2, 3] = PAD
    want = plain(h.reshape(-1, 16), w, t.reshape(-1), smoothing, z_loss)
    got = fl.fused_linear_cross_entropy(h, w, t, PAD, smoothing, z_loss, impl="liger", chunk_tokens=16)
    assert int(got[2]) == int(want[2]) == 45 - 6
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5)  # the nll, not the smoothed loss
    scale = 0.37  # a loss scaled after the fact (divided by the tokens, say) scales the gradients
    want_g = torch.autograd.grad(want[0] * scale, (h, w))
    got_g = torch.autograd.grad(got[0] * scale, (h, w))
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fl.fused_linear_cross_entropy(h, w, t, PAD, smoothing, z_loss, with_nll=False)[1] is None


def check_the_lm_training_step() -> None:
    """The dispatch of BaseModule.train_loss: hidden states and the (untied) head's weight reach the library, with
    the run's smoothing and z-loss; same loss, nll and parameter gradients as the logits path."""
    logged = []
    LMModule.log_train_step = lambda self, loss, nll, n: logged.append(nll)  # logging needs a Trainer
    g = torch.Generator().manual_seed(2)
    batch = {"input": torch.randint(3, 60, (2, 9), generator=g), "target": torch.randint(3, 60, (2, 9), generator=g)}
    batch["target"][1, 6:] = PAD
    model = ModelConfig(arch="decoder_only", vocab_size=60, d_model=32, n_heads=4, n_dec_layers=1, dropout=0.0,
                        tie_embeddings="none", z_loss=1e-3).to_dict()
    results = []
    for kernel in ("off", "liger"):
        lit_base.resolve_fused_loss = lambda *a, k=kernel: k  # what auto gives on CUDA
        torch.manual_seed(0)
        m = LMModule(model=model, optim={"label_smoothing": 0.1}).train()
        assert m.loss_kernel == ("plain" if kernel == "off" else "liger")
        loss = m.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logged[1], logged[0], rtol=1e-6, atol=1e-5)
    assert g0.keys() == g1.keys() and "model.head.weight" in g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)


def test_auto_picks_a_library_on_cuda_only_and_explicit_choices_say_why_they_cannot_run(monkeypatch):
    have = {"liger": True, "cce": True}
    monkeypatch.setattr(fl, "installed", lambda impl: have[impl])
    assert fl.resolve_fused_loss("auto", "cpu") == "off"  # today's path on a CPU
    assert fl.resolve_fused_loss("auto", "cuda", 0.1) == "liger"
    assert fl.resolve_fused_loss("off", "cuda") == "off"
    have["liger"] = False
    assert fl.resolve_fused_loss("auto", "cuda") == "cce"
    assert fl.resolve_fused_loss("auto", "cuda", 0.1) == "off"  # CCE has no label smoothing: the logits path
    assert fl.resolve_fused_loss("auto", "cuda", 0.0, 1e-4) == "off"  # nor z-loss
    with pytest.raises(ConfigError, match=r"trainer.fused_loss=liger needs liger-kernel.*attnlab\[gpu\]"):
        fl.resolve_fused_loss("liger", "cuda")
    with pytest.raises(ConfigError, match="trainer.fused_loss=cce: .*no label smoothing"):
        fl.resolve_fused_loss("cce", "cuda", 0.1)
    with pytest.raises(ConfigError, match="trainer.fused_loss=cce runs Triton kernels on a CUDA device.*on cpu"):
        fl.resolve_fused_loss("cce", "cpu")
    with pytest.raises(ConfigError, match="trainer.fused_loss='triton' is not one of: auto, liger, cce, off"):
        fl.resolve_fused_loss("triton", "cuda")


def test_the_trainer_option_is_checked_with_its_key_and_leaves_the_run_identity_alone(monkeypatch):
    with pytest.raises(ConfigError, match="trainer.fused_loss=.*'fast'.*auto, liger, cce, off"):
        TrainConfig(fused_loss="fast")
    with pytest.raises(ConfigError, match="trainer.fused_loss=liger and trainer.loss_chunk=64"):
        TrainConfig(fused_loss="liger", loss_chunk=64)
    with pytest.raises(ConfigError, match="trainer.fused_loss=cce is not supported with trainer.strategy=fsdp"):
        TrainConfig(fused_loss="cce", strategy="fsdp")
    assert TrainConfig(strategy="fsdp").fused_loss_choice == "off" and TrainConfig().fused_loss_choice == "auto"
    assert TrainConfig(loss_chunk=64).fused_loss == "auto"  # auto: the chunks where no library runs
    model = ModelConfig(arch="decoder_only", vocab_size=60, d_model=32, n_heads=4, n_dec_layers=1)
    exp = Experiment(name="t", model=model, data=DataConfig())
    with pytest.raises(ConfigError, match="trainer.fused_loss=cce: .*optim.label_smoothing=0.1"):
        exp.replace(trainer=TrainConfig(fused_loss="cce"), optim=OptimConfig(label_smoothing=0.1))
    liger = exp.replace(trainer=TrainConfig(fused_loss="liger"))
    assert liger.config_hash() == exp.config_hash()  # the same loss, so the same run
    assert make_module(liger).fused_loss == "liger" and make_module(exp).fused_loss == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.fused_loss=liger runs Triton kernels .* on cpu"):
        check_extras(liger)  # before any work


def test_on_a_cpu_auto_trains_on_the_logits_and_an_explicit_library_fails_at_fit_start():
    model = ModelConfig(vocab_size=60, d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=1).to_dict()
    assert Seq2SeqModule(model=model, optim={}).loss_kernel == "plain"
    assert Seq2SeqModule(model=model, optim={}, loss_chunk=8).loss_kernel == "chunked"
    m = Seq2SeqModule(model=model, optim={}, fused_loss="liger")
    with pytest.raises(ConfigError, match="trainer.fused_loss=liger runs Triton kernels on a CUDA device"):
        m.on_fit_start()
    with pytest.raises(ValueError, match="fused_loss='fast' is not one of"):
        Seq2SeqModule(model=model, optim={}, fused_loss="fast")


def test_the_benchmark_rows_of_the_fused_loss_skip_with_the_reason_on_a_cpu():
    """bench/train_throughput.py: attnlab-liger and attnlab-cce say why they cannot run here; the others still run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import train_throughput

    threads = torch.get_num_threads()
    try:
        rows = train_throughput.main(["--cpu", "--only", "lm/attnlab,lm/attnlab-liger,lm/attnlab-cce", "--steps", "1",
                                      "--warmup", "1"])
    finally:
        torch.set_num_threads(threads)
    status = {r["model"]: r["status"] for r in rows}
    assert status["attnlab"] == "ok"
    for name in ("attnlab-liger", "attnlab-cce"):
        assert status[name].startswith(f"skipped: trainer.fused_loss={name[8:]} runs Triton kernels on a CUDA device")
    assert [train_throughput.loss_kernel(n) for n in ("attnlab", "attnlab-chunked", "attnlab-liger-all",
                                                       "attnlab-blocks-liger", "attnlab-cce", "attnlab-blocks")] == [
        "plain", "chunked", "liger", "liger", "cce", "plain"]


if __name__ == "__main__":  # the interpreted checks (test_liger_matches_the_plain_path_under_the_triton_interpreter)
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for smoothing, z_loss in ((0.0, 0.0), (0.2, 1e-2)):
        check_loss_and_gradients(smoothing, z_loss)
        print("liger-parity-ok")
    check_the_lm_training_step()
    print("liger-parity-ok")
