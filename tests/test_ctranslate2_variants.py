"""`attnlab export --format ctranslate2` for every variant CTranslate2's Transformer represents: CTranslate2 (an
independent C++ implementation) scores a teacher-forced target with the log-probabilities attnlab computes, at
every position, within 1e-4 nats; greedy decoding gives attnlab's tokens; and a variant it cannot represent is
refused naming each field at fault.

The models are random, with jittered weights (norms away from 1, biases away from 0), in the layout fit writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.decode import generate, greedy_search
from test_export import checkpoint

ctranslate2 = pytest.importorskip("ctranslate2")

SMALL = dict(d_model=64, n_heads=4, n_enc_layers=2, n_dec_layers=2, d_ff=96)
PRE = dict(norm_position="pre")
TRANSLATION = {
    "post-norm 2017": {},
    "pre-norm": PRE,
    "sandwich": dict(norm_position="sandwich"),
    "pre RMSNorm SwiGLU no biases": dict(PRE, norm="rmsnorm", ffn="swiglu", attn_bias=False, ffn_bias=False),
    "GEGLU": dict(PRE, ffn="geglu"),
    "ReGLU post": dict(ffn="reglu"),
    "GELU": dict(ffn="gelu"),
    "GQA": dict(n_kv_heads=2),
    "MQA head_dim 24": dict(n_kv_heads=1, head_dim=24),
    "learned positions": dict(position="learned"),
    "RoPE": dict(PRE, position="rope"),
    "RoPE on half the head": dict(position="rope", rope_fraction=0.5),
    "no positions": dict(PRE, position="none"),
    "embedding norm": dict(PRE, embed_norm=True),
    "LayerNorm without bias": dict(norm_bias=False),
    "unscaled, untied": dict(scale_embeddings=False, tie_embeddings="none"),
    "decoder tied": dict(tie_embeddings="decoder"),
    "logit soft-capping": dict(logit_softcap=5.0),
}
LANGUAGE = {
    "Llama": dict(PRE, norm="rmsnorm", ffn="swiglu", position="rope", attn_bias=False, ffn_bias=False,
                  scale_embeddings=False),
    "post-norm": {},
    "GPT-2-like": dict(PRE, ffn="gelu", position="learned"),
    "ALiBi": dict(PRE, position="alibi"),
    "ALiBi, 6 heads": dict(PRE, position="alibi", n_heads=6, d_model=72),
    "parallel": dict(PRE, block="parallel"),
    "parallel RMSNorm RoPE": dict(PRE, block="parallel", norm="rmsnorm", position="rope"),
    "sandwich RMSNorm": dict(norm_position="sandwich", norm="rmsnorm"),
    "QK-norm": dict(PRE, qk_norm=True, position="rope"),
    "QK-norm RMSNorm": dict(PRE, qk_norm=True, norm="rmsnorm"),
    "logit soft-capping": dict(PRE, logit_softcap=3.0),
    "GQA head_dim 8": dict(PRE, n_kv_heads=2, head_dim=8, position="rope"),
}
LINES = ["the red house 5.", "open the window", "cannot find the network file 12."]


def export(tmp: Path, tok, name: str, **model) -> tuple[torch.nn.Module, Path, list[str]]:
    ckpt, net = checkpoint(tmp, tok, **{**SMALL, **model})
    out = tmp / "ct2"
    assert main(["export", "--ckpt", str(ckpt), "--format", "ctranslate2", "--out", str(out)]) == 0, name
    vocab = out / "shared_vocabulary.json"
    vocab = vocab if vocab.is_file() else out / "vocabulary.json"
    return net, out, json.loads(vocab.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", list(TRANSLATION))
def test_a_translation_variant_scores_and_translates_as_in_attnlab(tmp_path, tokenizer, name):
    net, out, vocab = export(tmp_path, tokenizer, name, arch="encoder_decoder", **TRANSLATION[name])
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
    for line in LINES:
        src = tokenizer.encode(line) + [tokenizer.eos_id]
        tgt = tokenizer.encode(line.upper(), side="tgt")[:12]
        theirs = translator.score_batch([[vocab[i] for i in src]], [[vocab[i] for i in tgt]])[0].log_probs
        with torch.no_grad():
            logp = net(torch.tensor([src]), torch.tensor([[tokenizer.bos_id] + tgt])).log_softmax(-1)[0]  # (T, V)
        ours = logp[torch.arange(len(tgt) + 1), torch.tensor(tgt + [tokenizer.eos_id])]  # (T,)
        torch.testing.assert_close(torch.tensor(theirs), ours, atol=1e-4, rtol=0)
        hyp = greedy_search(net, torch.tensor([src]), max_len_a=0.0, max_len_b=12)[0]
        result = translator.translate_batch([[vocab[i] for i in src]], beam_size=1, max_decoding_length=12)[0]
        assert [vocab.index(t) for t in result.hypotheses[0]] == hyp[:12], line


@pytest.mark.parametrize("name", list(LANGUAGE))
def test_a_language_model_variant_scores_and_generates_as_in_attnlab(tmp_path, tokenizer, name):
    net, out, vocab = export(tmp_path, tokenizer, name, arch="decoder_only", **LANGUAGE[name])
    generator = ctranslate2.Generator(str(out), device="cpu", compute_type="float32")
    for line in LINES:
        ids = [tokenizer.eos_id] + tokenizer.encode(line, side="tgt")
        theirs = generator.score_batch([[vocab[i] for i in ids]])[0].log_probs
        with torch.no_grad():
            logp = net(torch.tensor([ids])).log_softmax(-1)[0]  # (T, V)
        ours = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]  # (T - 1,)
        torch.testing.assert_close(torch.tensor(theirs), ours, atol=1e-4, rtol=0)
        new = generate(net, torch.tensor([ids]), max_new_tokens=12, greedy=True)[0][len(ids):]
        result = generator.generate_batch([[vocab[i] for i in ids]], max_length=12, sampling_topk=1,
                                          include_prompt_in_result=False, end_token=[])[0]
        assert [vocab.index(t) for t in result.sequences[0]] == new, line


@pytest.mark.parametrize(("arch", "model", "fields"), [
    ("encoder_decoder", dict(qk_norm=True, position="alibi", block="parallel"),
     ["model.qk_norm=True (needs False for a translation model", "model.position='alibi'", "model.block='parallel'"]),
    ("decoder_only", dict(block="parallel", attn_softcap=20.0, attention_backend="eager", v_head_dim=8),
     ["model.block='parallel' (needs 'serial'", "model.attn_softcap=20.0", "model.v_head_dim=8 (needs 0"]),
    ("encoder_only", {}, ["model.arch='encoder_only'"]),
])
def test_a_variant_it_cannot_represent_is_refused_naming_each_field(tmp_path, tokenizer, capsys, arch, model,
                                                                     fields):
    ckpt, _ = checkpoint(tmp_path, tokenizer, **{**SMALL, "arch": arch, **model})
    out = tmp_path / "ct2"
    assert main(["export", "--ckpt", str(ckpt), "--format", "ctranslate2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "CTranslate2's Transformer cannot represent this variant" in err
    for field in fields:
        assert field in err
    assert err.count("; ") == len(fields) - 1  # those fields and no other
    assert not out.exists()


def test_the_engine_stops_where_a_learned_position_table_ends_as_attnlab_does(tmp_path, tokenizer):
    """With learned positions, decoding stops at the table's last row (decode.position_cap). CTranslate2 refuses a
    position past its table, so the engine must ask for no more: here 15 tokens where max_len_b asks for 40."""
    from attnlab.config import DecodeConfig
    from attnlab.evaluate import load_module, translate_lines
    from attnlab.export_ct2 import ct2_translate

    ckpt, _ = checkpoint(tmp_path, tokenizer, **{**SMALL, "max_seq_len": 16, "position": "learned"})
    decode = DecodeConfig(max_len_a=0.0, max_len_b=40, beam=1)
    module = load_module(ckpt, decode)
    lines = ["the red house", "open the window 5."]
    ours = translate_lines(module, tokenizer, lines, device="cpu")
    assert translate_lines(module, tokenizer, lines, device="cpu", engine="ctranslate2", ckpt_path=ckpt) == ours
    sources = [tokenizer.encode(line) + [tokenizer.eos_id] for line in lines]
    ids = ct2_translate(ckpt, sources, [[0, 1]], decode, 1, torch.device("cpu"), None, cap=15)
    assert max(map(len, ids)) == 15  # random weights: cut at the cap, not at an EOS
    with pytest.raises(RuntimeError, match="No position encodings are defined for positions >= 16"):
        ct2_translate(ckpt, sources, [[0, 1]], decode, 1, torch.device("cpu"), None)  # what the cap avoids


