"""`attnlab export --format hf`: a decoder-only checkpoint loads in transformers as LlamaForCausalLM and an
encoder-decoder one as MarianMTModel, and HF's greedy `generate` gives exactly attnlab's tokens; the exported
tokenizer is the checkpoint's; a variant that does not map is an error naming every field that does not.

The checkpoints are made here from models with jittered weights (norms away from 1, biases away from 0), in the
layout fit writes (state_dict under `model.`, the config in hyper_parameters, the tokenizer inside)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.config import ModelConfig
from attnlab.data.tokenizer import Tokenizer
from attnlab.decode import generate, greedy_search
from attnlab.models.transformer import build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def checkpoint(tmp: Path, tok: Tokenizer, seed: int = 0, **model) -> tuple[Path, torch.nn.Module]:
    cfg = ModelConfig(**{"vocab_size": tok.vocab_size, "dropout": 0.0, "max_seq_len": 128, **model})
    torch.manual_seed(seed)
    net = build_model(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():  # a tied table is one parameter: jittered once
            p.add_(0.1 * torch.randn(p.shape))
    path = tmp / f"{cfg.arch}-{seed}.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in net.state_dict().items()}, "attnlab_format": 2,
                "hyper_parameters": {"model": cfg.to_dict(), "optim": {}}, "tokenizer": tok.to_files()}, path)
    return path, net


LLAMA = dict(arch="decoder_only", d_model=64, n_heads=4, n_kv_heads=2, n_dec_layers=2, d_ff=96, norm="rmsnorm",
             norm_position="pre", ffn="swiglu", position="rope", rope_theta=5e4, attn_bias=False, ffn_bias=False,
             scale_embeddings=False, init="normal")
GPT2 = dict(norm="layernorm", ffn="gelu", position="learned", attn_bias=True, ffn_bias=True, n_kv_heads=0)
MARIAN = dict(arch="encoder_decoder", d_model=64, n_heads=4, n_enc_layers=2, n_dec_layers=2, d_ff=96)


@pytest.mark.parametrize(("tie", "variant", "name"), [
    ("decoder", {}, "LlamaForCausalLM"),
    ("none", {}, "LlamaForCausalLM"),
    ("decoder", {"attn_bias": True, "ffn_bias": True, "head_dim": 24}, "LlamaForCausalLM"),
    ("none", {"qk_norm": True, "attn_bias": True, "n_kv_heads": 1}, "Qwen3ForCausalLM"),
    ("decoder", GPT2, "GPT2LMHeadModel"),
    ("none", {**GPT2, "ffn": "relu", "d_ff": 80}, "GPT2LMHeadModel"),
])
def test_llama_export_generates_attnlab_tokens(tmp_path, tokenizer, tie, variant, name, capsys):
    ckpt, net = checkpoint(tmp_path, tokenizer, tie_embeddings=tie, **{**LLAMA, **variant})
    out = tmp_path / f"hf-{tie}"
    assert main(["export", "--ckpt", str(ckpt), "--format", "hf", "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == name and hf.config.tie_word_embeddings == (tie == "decoder")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    continuations = set()
    for text in ["the red house", "open the file 5.", "network error"]:
        ids = [tokenizer.eos_id] + tokenizer.encode(text, side="tgt")
        assert hf_tok(text)["input_ids"] == ids  # the exported tokenizer starts with EOS, as attnlab generate
        ours = generate(net, torch.tensor([ids]), max_new_tokens=20, greedy=True)[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None)[0]
        assert theirs.tolist() == ours, text
        continuations.add(tuple(ours[len(ids):]))
    assert len(continuations) > 1  # the model's output depends on its input
    with torch.no_grad():  # and the logits themselves, full sequence
        x = torch.tensor([[2] + tokenizer.encode("the big red house cannot find the old file")])
        torch.testing.assert_close(hf(x).logits, net(x), atol=1e-4, rtol=1e-4)


def test_marian_export_translates_like_attnlab(tmp_path, tokenizer):
    ckpt, net = checkpoint(tmp_path, tokenizer, seed=1, **MARIAN)
    out = tmp_path / "marian"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MarianMTModel"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    lines = ["the red house 5.", "open the window", "cannot find the network file 12."]
    src = [tokenizer.encode(s) + [tokenizer.eos_id] for s in lines]
    width = max(map(len, src))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in src])  # (B, S), right-padded
    ours = greedy_search(net, batch, max_len_a=0.0, max_len_b=16)
    with torch.no_grad():
        theirs = hf.generate(batch, attention_mask=batch.ne(0), max_new_tokens=16, do_sample=False, num_beams=1)
    for row, hyp in zip(theirs.tolist(), ours, strict=True):
        assert row[0] == tokenizer.bos_id
        body = row[1:]
        cut = body.index(tokenizer.eos_id) if tokenizer.eos_id in body else len(body)
        assert body[:cut] == hyp
    assert len({tuple(h) for h in ours}) > 1  # the output depends on the input
    with torch.no_grad():  # and the logits themselves, teacher-forced, at every non-padding position
        tgt = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(s.upper()) for s in ["the red house 5."] * 3])
        theirs = hf(input_ids=batch, attention_mask=batch.ne(0), decoder_input_ids=tgt).logits
        torch.testing.assert_close(theirs, net(batch, tgt), atol=1e-4, rtol=1e-4)
    assert hf_tok.decode(ours[0], skip_special_tokens=True) == tokenizer.decode(ours[0])


def test_a_variant_that_does_not_map_names_every_field(tmp_path, tokenizer, capsys):
    ckpt, _ = checkpoint(tmp_path, tokenizer, **{**LLAMA, "norm": "layernorm", "position": "alibi", "v_head_dim": 8})
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "does not map onto LlamaForCausalLM" in err
    for field in ("model.norm='layernorm' (needs 'rmsnorm')", "model.position='alibi' (needs 'rope')",
                  "model.v_head_dim=8 (needs 0)"):
        assert field in err
    assert "model.ffn" not in err and not (tmp_path / "x").exists()
    ckpt, _ = checkpoint(tmp_path, tokenizer, seed=1, **{**LLAMA, "qk_norm": True, "ffn_bias": True})
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "does not map onto Qwen3ForCausalLM: model.ffn_bias=True (needs False)" in err
    ckpt, _ = checkpoint(tmp_path, tokenizer, seed=2, **{**MARIAN, "norm_position": "pre", "position": "rope"})
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "MarianMTModel" in err and "model.norm_position='pre'" in err and "model.position='rope'" in err
