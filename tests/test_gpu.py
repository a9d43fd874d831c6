"""GPU checks (skipped without CUDA): the SDPA flash kernel really runs in bf16 and agrees with fp32 math."""

import pytest
import torch

from attnlab.config import ModelConfig
from attnlab.models import build_model

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
