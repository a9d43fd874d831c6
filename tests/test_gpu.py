"""GPU checks (skipped without CUDA): the SDPA flash kernel in bf16 against fp32 math, bf16 training against fp32
loss curves, the chunked loss in bf16 and its memory, CUDA-graph decoding against the growing cache, beam
search's tie order on CUDA, a deterministic fit repeated bit for bit."""

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
