"""GPU checks (skipped without CUDA): the SDPA flash kernel in bf16 against fp32 math, bf16 training against fp32
loss curves, the chunked loss in bf16 and its memory, the fused loss libraries (trainer.fused_loss) against the plain
loss, CUDA-graph decoding against the growing cache, beam search's tie order on CUDA, a deterministic fit repeated
bit for bit."""

import pytest
import torch

from attnlab.config import ModelConfig
from attnlab.models.transformer import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; CI has none"),
]


def lm_config(**kw):
    base = dict(arch="decoder_only", vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, n_dec_layers=2,
                norm="rmsnorm", norm_position="pre", ffn="swiglu", position="rope", attn_bias=False,
                ffn_bias=False, dropout=0.0, tie_embeddings="none")
    base.update(kw)
    return ModelConfig(**base)


def kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_flash_kernel_is_used_in_bf16_and_matches_fp32(n_kv_heads):
    torch.manual_seed(0)
    cfg = lm_config(n_kv_heads=n_kv_heads)
    model = build_model(cfg).cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    with torch.no_grad():
        ref = model(ids).float()  # fp32 math
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def bf16():
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return model(ids)  # raises if the flash kernel cannot take these inputs

        out = bf16().float()
        names = kernel_names(bf16)
    assert any("flash" in n.lower() for n in names), names
    err = (out - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err  # bf16 tolerance


def test_encoder_decoder_bf16_training_step_is_finite():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_heads=4, n_enc_layers=2, n_dec_layers=2, dropout=0.1)
    model = build_model(cfg).cuda()
    src = torch.randint(4, 512, (8, 40), device="cuda")
    src[:, 30:] = 0
    tgt = torch.randint(4, 512, (8, 35), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(src, tgt)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_flash_attn_package_matches_sdpa_with_padding_and_cache():
    """The flash_attn backend (the flash-attn package; skipped where it is not installed) against sdpa in bf16:
    an encoder-decoder with padded sources (the varlen kernel) and cached decoding after a prefix."""
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, n_enc_layers=2, n_dec_layers=2,
                      position="rope", norm_position="pre", dropout=0.0)
    sdpa = build_model(cfg).cuda().eval()
    flash = build_model(cfg.replace(attention_backend="flash_attn")).cuda().eval()
    flash.load_state_dict(sdpa.state_dict())
    src = torch.randint(4, 512, (4, 40), device="cuda")
    src[1, 25:] = 0
    src[3, 10:] = 0
    tgt = torch.randint(4, 512, (4, 30), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = sdpa(src, tgt).float()
        got = flash(src, tgt).float()
        memory, src_pad = flash.encode(src)
        cache = flash.new_cache()
        steps = [flash.decode(tgt[:, :10], memory, src_pad, cache=cache),
                 flash.decode(tgt[:, 10:20], memory, src_pad, cache=cache)]
        steps += [flash.decode(tgt[:, t:t + 1], memory, src_pad, cache=cache) for t in range(20, 30)]
    tol = 0.05 * want.abs().max().item()
    assert (got - want).abs().max().item() < tol
    assert (torch.cat(steps, dim=1).float() - want).abs().max().item() < tol


# ------------------------------------------------------------------------------------------ numerics
def train_losses(cfg: ModelConfig, batch: tuple[torch.Tensor, ...], steps: int, bf16: bool) -> list[float]:
    """Per-step training losses of `steps` AdamW steps on one fixed batch, from the seed-0 initialisation."""
    from attnlab.lit.loss import token_loss

    torch.manual_seed(0)
    model = build_model(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), fused=True)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(*batch[:-1])  # (B, T, V)
        loss_sum, _, n = token_loss(logits, batch[-1], cfg.pad_id, label_smoothing=0.1)
        loss = loss_sum / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_bf16_autocast_training_follows_the_fp32_loss_curve(arch):
    """20 steps of bf16-autocast training against the same 20 steps in fp32 (dropout off, same data): every
    step's loss within bf16 tolerance, and both curves fall (so the comparison is not of two flat lines)."""
    torch.manual_seed(1)
    if arch == "encoder_decoder":
        cfg = ModelConfig(vocab_size=512, d_model=128, n_heads=4, n_enc_layers=2, n_dec_layers=2, dropout=0.0)
        src = torch.randint(4, 512, (16, 32), device="cuda")
        src[:4, 20:] = 0
        tgt = torch.randint(4, 512, (16, 25), device="cuda")
        batch = (src, tgt[:, :-1], tgt[:, 1:])
    else:
        cfg = lm_config(d_model=128, dropout=0.0)
        ids = torch.randint(4, 512, (8, 129), device="cuda")
        batch = (ids[:, :-1], ids[:, 1:])
    fp32 = train_losses(cfg, batch, 20, bf16=False)
    bf16 = train_losses(cfg, batch, 20, bf16=True)
    assert fp32[-1] < 0.9 * fp32[0] and bf16[-1] < 0.9 * bf16[0], (fp32, bf16)
    for step, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        assert abs(a - b) <= 0.03 * a + 0.01, f"step {step}: fp32 {a:.4f} vs bf16 {b:.4f}\n{fp32}\n{bf16}"


def test_chunked_loss_matches_the_plain_loss_in_bf16_and_needs_less_memory():
    from attnlab.lit.loss import linear_cross_entropy, token_loss

    torch.manual_seed(0)
    N, d, V = 8192, 512, 32000
    h = torch.randn(N, d, device="cuda", requires_grad=True)
    w = (torch.randn(V, d, device="cuda") * d**-0.5).requires_grad_()
    t = torch.randint(1, V, (N,), device="cuda")
    results = []
    for chunked in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss = linear_cross_entropy(h, w, t, 0, 0.1, 1e-4, chunk=1024)[0]
            else:
                loss = token_loss(torch.nn.functional.linear(h, w), t, 0, 0.1, 1e-4)[0]
        grads = torch.autograd.grad(loss, (h, w))
        torch.cuda.synchronize()
        results.append((loss.detach(), grads, torch.cuda.max_memory_allocated() - base))
    (l0, g0, m0), (l1, g1, m1) = results
    assert abs(l1.item() - l0.item()) < 1e-3 * abs(l0.item())
    for a, b in zip(g1, g0, strict=True):
        assert (a - b).abs().max() < 0.02 * b.abs().max()
    assert m1 < 0.5 * m0, (m1, m0)


def fused_case(N: int, V: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (N, d), an output weight (V, d) giving logits of std ~2, targets (N,) with ~10% padding (0)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, d, device="cuda", generator=g).requires_grad_()  # (N, d)
    w = (torch.randn(V, d, device="cuda", generator=g) * 2 * d**-0.5).requires_grad_()  # (V, d)
    t = torch.randint(1, V, (N,), device="cuda", generator=g)  # (N,)
    t[torch.rand(N, device="cuda", generator=g) < 0.1] = 0
    return h, w, t


def plain_fused_reference(h, w, t, smoothing, z_loss, softcap):
    """token_loss of softcap(h @ w^T), the logits in autocast's dtype as the model's output layer makes them."""
    from attnlab.lit.loss import token_loss

    logits = torch.nn.functional.linear(h, w)  # (N, V)
    if softcap:
        logits = softcap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / softcap)
    return token_loss(logits, t, 0, smoothing, z_loss)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("smoothing,z_loss,softcap", [(0.1, 1e-3, 0.0), (0.1, 1e-3, 3.0), (0.0, 0.0, 3.0)])
def test_liger_fused_loss_equals_the_plain_path_in_fp32(smoothing, z_loss, softcap):
    """Liger's fused linear cross-entropy (trainer.fused_loss liger) in fp32 against token_loss on the logits: loss,
    nll (a second, gradient-free call when smoothing or z-loss is on) and both gradients, with padding; 4,096
    tokens over a 32k vocabulary take 32 of its chunks."""
    pytest.importorskip("liger_kernel", reason="the gpu extra: pip install 'attnlab[gpu]'")
    from attnlab.lit.fused_loss import fused_linear_cross_entropy

    h, w, t = fused_case(4096, 32000, 512)
    want = plain_fused_reference(h, w, t, smoothing, z_loss, softcap)
    got = fused_linear_cross_entropy(h, w, t, 0, smoothing, z_loss, softcap, impl="liger", chunk_tokens=128)
    assert int(got[2]) == int(want[2]) == int(t.ne(0).sum())
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0.0)
    want_g = torch.autograd.grad(want[0] * 0.37, (h, w))  # scaled: the backward's rescaling kernel runs too
    got_g = torch.autograd.grad(got[0] * 0.37, (h, w))
    for name, a, b in zip(("dL/dh", "dL/dW"), got_g, want_g, strict=True):
        assert max_err(a, b) <= 1e-5 * b.abs().max().item(), name


@pytest.mark.parametrize("impl", ["liger", "cce"])
@pytest.mark.parametrize("smoothing,z_loss,softcap", [(0.1, 1e-3, 0.0), (0.1, 1e-3, 3.0), (0.0, 0.0, 3.0),
                                                     (0.0, 0.0, 0.0)])
def test_fused_loss_in_bf16_is_as_exact_as_the_plain_path_and_needs_less_memory(impl, smoothing, z_loss, softcap):
    """Under bf16 autocast (how training runs on a GPU): loss, nll and gradients of the fused library and of the
    plain bf16 path, each against the fp64 computation on the same bf16-rounded inputs; liger's error is at most
    twice the plain path's, and the library holds less than half the plain path's extra memory (8,192 tokens, 32k
    vocabulary). CCE has no label smoothing and no z-loss: those cases are refused, with the reason.

    CCE 25.1.1 is less exact: it sums dL/dh over vocabulary blocks and dL/dW over token blocks in bf16 buffers
    (cce_backward.py), and its summed loss differs from the exact one by a few 1e-6 of it. On an H100 (2026-11-26,
    soft-cap 3) its dL/dh was off by 5.7% of the largest entry, 15 times the plain path's error, and its loss by
    0.25 of ~78,000 (the plain path: 0.008). Its bounds are those, with room: a relative 1e-4 on the loss, 10% of
    the largest entry on each gradient."""
    pytest.importorskip(PACKAGE_OF[impl], reason="the gpu extra: pip install 'attnlab[gpu]'")
    from attnlab.config import ConfigError
    from attnlab.lit.fused_loss import fused_linear_cross_entropy

    h, w, t = fused_case(8192, 32000, 512, seed=1)
    if impl == "cce" and (smoothing or z_loss):
        with pytest.raises(ConfigError, match="no label smoothing"), torch.autocast("cuda", dtype=torch.bfloat16):
            fused_linear_cross_entropy(h, w, t, 0, smoothing, z_loss, softcap, impl=impl)
        return
    h64, w64 = (x.detach().bfloat16().double().requires_grad_() for x in (h, w))  # the inputs autocast multiplies
    exact = plain_fused_reference(h64, w64, t, smoothing, z_loss, softcap)
    exact_g = torch.autograd.grad(exact[0], (h64, w64))
    results = []
    for fused in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                out = fused_linear_cross_entropy(h, w, t, 0, smoothing, z_loss, softcap, impl=impl)
            else:
                out = plain_fused_reference(h, w, t, smoothing, z_loss, softcap)
        grads = torch.autograd.grad(out[0], (h, w))
        torch.cuda.synchronize()
        results.append((out, grads, torch.cuda.max_memory_allocated() - base))
    (plain, plain_g, plain_mem), (got, got_g, got_mem) = results
    assert got[0].dtype == torch.float32 and got_g[0].dtype == got_g[1].dtype == torch.float32
    assert int(got[2]) == int(plain[2])
    for name, a, b, ref in [("loss", got[0], plain[0], exact[0]), ("nll", got[1], plain[1], exact[1]),
                            ("dL/dh", got_g[0], plain_g[0], exact_g[0]), ("dL/dW", got_g[1], plain_g[1], exact_g[1])]:
        scale = ref.abs().max().item()
        if impl == "cce":
            assert max_err(a, ref) <= (1e-4 if name in ("loss", "nll") else 0.1) * scale, (name, max_err(a, ref))
        else:  # the floor: where both round alike
            assert max_err(a, ref) <= 2 * max_err(b, ref) + 1e-6 * scale, (name, max_err(a, ref), max_err(b, ref))
    assert got_mem < 0.5 * plain_mem, (got_mem, plain_mem)


PACKAGE_OF = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


@pytest.mark.parametrize("compile", [False, True])
def test_the_training_step_takes_the_fused_loss_on_cuda_by_default(compile):
    """trainer.fused_loss auto on CUDA with the gpu extra installed: LMModule's training step (bf16 autocast; its
    blocks compiled with `compile`, as trainer.compile does) runs liger on the hidden states and gives the loss
    and parameter gradients of fused_loss off, within bf16 tolerance."""
    pytest.importorskip("liger_kernel", reason="the gpu extra: pip install 'attnlab[gpu]'")
    from attnlab.lit import LMModule

    cfg = lm_config(vocab_size=4096, z_loss=1e-4, logit_softcap=30.0).to_dict()
    ids = torch.randint(4, 4096, (4, 129), device="cuda")
    batch = {"input": ids[:, :-1], "target": ids[:, 1:].clone()}
    batch["target"][0, 100:] = 0
    results = []
    for fused in ("off", "auto"):
        torch.manual_seed(0)
        m = LMModule(model=cfg, optim={"label_smoothing": 0.1}, compile=compile, fused_loss=fused).cuda().train()
        m.configure_model()
        m.log_train_step = lambda *a: None  # logging needs a Trainer
        assert m.loss_kernel == ("plain" if fused == "off" else "liger")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert abs(l1.item() - l0.item()) <= 2e-3 * abs(l0.item()), (l1, l0)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        assert max_err(g1[name], g0[name]) <= 0.02 * g0[name].abs().max().item() + 1e-6, name


# ------------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("compile_step", [False, True])
def test_cuda_graph_decoding_gives_the_tokens_of_the_dynamic_cache(compile_step):
    """generate(cache='graph') captures one step as a CUDA graph (after compiling it, with compile_step) and
    replays it per token: fp32 weights, greedy, the same tokens as the growing cache."""
    from attnlab.decode import generate

    torch.manual_seed(0)
    model = build_model(lm_config()).cuda().eval()
    prompt = torch.randint(4, 512, (4, 16), device="cuda")
    want = generate(model, prompt, 24, greedy=True)
    got = generate(model, prompt, 24, greedy=True, cache="graph", compile_step=compile_step)
    assert got == want
    again = generate(model, prompt, 24, greedy=True, cache="graph", compile_step=compile_step)
    assert again == want  # a second capture over a fresh cache


def test_translation_graph_decoding_gives_the_tokens_of_the_shrinking_batch():
    """greedy_search / beam_search(graph=True) on CUDA: the decoder step captured once as a CUDA graph and
    replayed, every row kept; fp32 weights, the same tokens as the default path, padded sources included."""
    from attnlab.decode import beam_search, greedy_search

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, n_enc_layers=2, n_dec_layers=2,
                      dropout=0.0)
    model = build_model(cfg).cuda().eval()
    src = torch.randint(4, 512, (6, 20), device="cuda")
    src[1, 12:] = 0
    src[4, 5:] = 0
    assert greedy_search(model, src, graph=True) == greedy_search(model, src)
    a, b = (beam_search(model, src, beam_size=4, nbest=2, graph=g) for g in (True, False))
    assert [[h for h, _ in s] for s in a] == [[h for h, _ in s] for s in b]


def test_beam_step_ties_keep_the_earlier_finished_first_on_cuda():
    """choose_beams' stable merge on CUDA, whose sort of a short row is not stable unless asked."""
    from test_decode import check_ties_keep_the_earlier_finished

    check_ties_keep_the_earlier_finished("cuda")


@pytest.mark.parametrize("beam", [1, 4])
def test_decode_cuda_graph_in_the_lightning_module_under_bf16_autocast(beam, monkeypatch):
    """decode.cuda_graph: Seq2SeqModule.translate_ids (validation, test, translate) with every decoder step a CUDA
    graph, inside bf16 autocast as Lightning's bf16-mixed runs it, twice (a second capture in a new autocast
    region), gives the tokens of the default path. The embedding (tied to the output) is scaled up so that the
    argmax margins stand far above bf16's rounding, which differs between the kept and the shrinking batch."""
    from attnlab.decode import DecodeStep
    from attnlab.lit import Seq2SeqModule

    captures = []
    capture = DecodeStep._capture
    monkeypatch.setattr(DecodeStep, "_capture", lambda self: (captures.append(1), capture(self))[1])
    torch.manual_seed(0)
    cfg = dict(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, n_enc_layers=2, n_dec_layers=2, dropout=0.0)
    mods = [Seq2SeqModule(cfg, {}, decode={"cuda_graph": g}).cuda().eval() for g in (True, False)]
    mods[1].load_state_dict(mods[0].state_dict())
    with torch.no_grad():
        for m in mods:
            m.model.encoder.embed.weight.mul_(8)
    src = torch.randint(4, 512, (12, 20), device="cuda")
    src[1, 12:] = 0
    src[4, 5:] = 0
    out = []
    for m in (mods[0], mods[1], mods[0]):
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            out.append(m.translate_ids(src, beam))
        assert len(captures) == (1 if len(out) < 3 else 2)  # one capture a call with cuda_graph, none without
    assert out[0] == out[1] == out[2]
    assert sum(map(len, out[0])) > 12  # real outputs, not all empty


def sdpa_ops(fn) -> set[str]:
    """The SDPA kernels (aten ops) a call runs, from the profiler: flash, efficient (memory-efficient), math."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_efficient_attention": "efficient",
             "_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_attention_math": "math",
             "_flash_attention_backward": "flash", "_efficient_attention_backward": "efficient"}
    return {kind for e in prof.key_averages() for op, kind in kinds.items() if e.key.endswith(op)}


@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_training_and_cached_decoding_run_fast_sdpa_kernels_unforced(n_kv_heads):
    """What SDPA picks by itself (no sdpa_kernel forcing) on the real paths, bf16 autocast: a training step of
    the encoder-decoder with an unpadded batch (no mask: flash), with a padded one (masks: never the math
    fallback, GQA included), and beam search over the KV cache (never math); cuDNN never (a plan per new shape)."""
    from attnlab.decode import beam_search

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=512, n_heads=8, n_kv_heads=n_kv_heads, n_enc_layers=2,
                      n_dec_layers=2, dropout=0.1)
    model = build_model(cfg).cuda()
    src, tgt = torch.randint(4, 512, (8, 40), device="cuda"), torch.randint(4, 512, (8, 35), device="cuda")

    def step(src, padded):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt, src_padded=padded)  # (B, T, V)
        logits.float().logsumexp(-1).mean().backward()

    kinds = sdpa_ops(lambda: step(src, False))
    assert kinds == {"flash"}, kinds  # no mask: the flash kernel (never cuDNN: a plan per shape, see attention.py)
    padded = src.clone()
    padded[:, 30:] = 0
    kinds = sdpa_ops(lambda: step(padded, True))
    assert kinds and not kinds & {"math", "cudnn"}, kinds
    model.eval()

    def decode():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            beam_search(model, padded, beam_size=4, max_len_a=0, max_len_b=12, min_len=12)

    kinds = sdpa_ops(decode)
    assert kinds and not kinds & {"math", "cudnn"}, kinds


# ------------------------------------------------------------------------------------------ reproducibility
def test_a_deterministic_fit_repeats_bit_for_bit(tmp_path):
    """trainer.deterministic on CUDA: two `attnlab fit` processes of the same recipe (bf16, dropout, padded
    batches, a validation that decodes) end with the same weights, bit for bit, or stop naming an op that has no
    deterministic kernel."""
    import subprocess
    import sys

    from attnlab.checkpoints import load_checkpoint
    from test_train import write_recipe

    recipe = write_recipe(tmp_path, model={"d_model": 128, "n_heads": 4, "n_enc_layers": 2, "n_dec_layers": 2,
                                           "d_ff": 256, "dropout": 0.1},
                          trainer={"max_steps": 30, "val_every": 30, "ckpt_every": 30, "deterministic": True})
    weights = []
    for name in ("a", "b"):
        r = subprocess.run([sys.executable, "-m", "attnlab", "fit", "-c", str(recipe), "--trainer.run_name", name],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        ckpt = load_checkpoint(tmp_path / "runs" / name / "checkpoints" / "last.ckpt")
        assert ckpt["global_step"] == 30
        weights.append(ckpt["state_dict"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_background_checkpoint_write_during_a_cuda_graph_capture(tmp_path, monkeypatch):
    """trainer.checkpoint_writes background: the writer thread pickles a host snapshot and makes no CUDA call, so a
    write that runs while the training thread captures a CUDA graph (validation's beam step) leaves the capture
    whole. The 2026-11-26 H100 fit died at its first validation when the thread moved a device copy to the host."""
    import threading

    import attnlab.checkpoint_io as cio

    capturing, written = threading.Event(), threading.Event()
    real = cio.save_atomic

    def during_capture(obj, path):
        capturing.wait(30)
        real(obj, path)
        written.set()

    monkeypatch.setattr(cio, "save_atomic", during_capture)
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda")
    io = cio.AtomicCheckpointIO(background=True)
    io.save_checkpoint({"state_dict": {"w": w}, "optimizer_states": [{"m": torch.randn(1000, device="cuda")}]},
                       tmp_path / "c.ckpt")
    x = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        x @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode "global": any thread's unsafe CUDA call fails it
        y = x @ w
        capturing.set()
        assert written.wait(30), "the checkpoint thread did not finish its write during the capture"
    graph.replay()
    torch.cuda.synchronize()
    io.teardown()
    saved = torch.load(tmp_path / "c.ckpt", weights_only=False)
    assert saved["state_dict"]["w"].device.type == "cpu" and torch.equal(saved["state_dict"]["w"], w.cpu())
    assert torch.allclose(y, x @ w)
