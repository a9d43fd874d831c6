"""A checkpoint as a Hugging Face model folder: `model.safetensors`, `config.json`, `generation_config.json` and the
tokenizer, which `transformers` loads without attnlab (`AutoModelForCausalLM` / `AutoModelForSeq2SeqLM`).

- decoder-only -> `LlamaForCausalLM` (Touvron et al. 2023), where the variant is Llama's: pre-norm RMSNorm,
  SwiGLU, RoPE over the whole head, a serial block, no soft-capping; any head_dim, GQA/MQA, attention and FFN
  biases on or off (Llama's attention_bias, mlp_bias). With QK-norm -> `Qwen3ForCausalLM` (the same, with an
  RMSNorm over each head's queries and keys before RoPE; no FFN biases). With learned positions ->
  `GPT2LMHeadModel` (pre-norm LayerNorm, biases everywhere, ReLU or exact GELU, multi-head attention).
- encoder-decoder -> `MarianMTModel` (Junczys-Dowmunt et al. 2018), where the variant is the 2017 Transformer
  Marian implements: post-norm LayerNorm with biases (eps 1e-5), ReLU or GELU, sinusoidal positions, one table
  for source, target and output, multi-head attention.

A variant that does not map is an error listing every field that does not. A field this module does not know
(one added to ModelConfig later) maps only at its default value, so a new variant is never exported silently
wrong. `tests/test_export.py` checks that HF's greedy `generate` gives exactly attnlab's tokens.

Marian's sinusoids are [sin(all frequencies) | cos(all frequencies)]; attnlab's interleave them (the paper's
PE(pos, 2i), PE(pos, 2i+1)). LayerNorm, attention and the FFN do not care in which order the d_model coordinates
of the residual stream come, so the export reorders them throughout (`perm`): every weight that reads the
residual stream has its input columns permuted, every one that writes it its output rows, norms and biases
alike. The two models then compute the same function.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from .checkpoints import load_checkpoint, load_tokenizer
from .config import ConfigError, ModelConfig
from .data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, encode_as_trained
from .decode import GENERATE_MAX_NEW_TOKENS
from .models.layers import sinusoidal_positions

# field -> the values that map. Fields in FREE map whatever their value (sizes, regularisation, initialisation,
# kernels); any other field maps only at ModelConfig's default.
ANY = ()  # a rule that maps every value of its field
LLAMA: dict[str, tuple[Any, ...]] = {
    "arch": ("decoder_only",), "norm": ("rmsnorm",), "norm_position": ("pre",), "ffn": ("swiglu",),
    "block": ("serial",), "position": ("rope",), "rope_fraction": (1.0,), "attn_bias": (False, True),
    "ffn_bias": (False, True), "qk_norm": (False,), "scale_embeddings": (False,), "tie_embeddings": ("none", "decoder"),
    "logit_softcap": (0.0,), "attn_softcap": (0.0,), "head_dim": ANY,
}
# Qwen3 (Yang et al. 2025, arXiv:2505.09388) is Llama with QK-norm: an RMSNorm over each head's queries and keys
# before RoPE, as attnlab's qk_norm; its FFN has no biases
QWEN3 = {**LLAMA, "qk_norm": (True,), "ffn_bias": (False,)}
# GPT-2 (Radford et al. 2019): pre-norm LayerNorm with biases, learned positions, biases everywhere, ReLU or GELU
# (exact: activation_function "gelu", not GPT-2's own tanh approximation), multi-head attention
GPT2 = {"arch": ("decoder_only",), "norm": ("layernorm",), "norm_position": ("pre",), "ffn": ("gelu", "relu"),
        "block": ("serial",), "position": ("learned",), "attn_bias": (True,), "ffn_bias": (True,),
        "norm_bias": (True,), "qk_norm": (False,), "scale_embeddings": (False,), "n_kv_heads": (0,),
        "tie_embeddings": ("none", "decoder"), "logit_softcap": (0.0,), "attn_softcap": (0.0,)}
MARIAN: dict[str, tuple[Any, ...]] = {
    "arch": ("encoder_decoder",), "norm": ("layernorm",), "norm_position": ("post",), "ffn": ("relu", "gelu"),
    "block": ("serial",), "position": ("sinusoidal",), "attn_bias": (True,), "ffn_bias": (True,),
    "norm_bias": (True,), "qk_norm": (False,), "tie_embeddings": ("all",), "n_kv_heads": (0,), "norm_eps": (1e-5,),
    "logit_softcap": (0.0,), "attn_softcap": (0.0,),
}
FREE = {"vocab_size", "src_vocab_size", "d_model", "n_heads", "n_kv_heads", "n_enc_layers", "n_dec_layers", "d_ff",
        "ffn_multiple_of", "max_seq_len", "norm_eps", "rope_theta", "norm_bias", "scale_embeddings", "dropout",
        "attn_dropout", "z_loss", "attention_backend", "init", "init_std", "pad_id", "rope_fraction"}
TARGETS = {"decoder_only": ("LlamaForCausalLM", LLAMA), "encoder_decoder": ("MarianMTModel", MARIAN)}


def target(cfg: ModelConfig) -> tuple[str, dict[str, tuple[Any, ...]]] | None:
    """The Hugging Face class a variant is written as, and its rules; None for an arch with no export."""
    if cfg.arch == "decoder_only" and cfg.position == "learned":
        return "GPT2LMHeadModel", GPT2
    if cfg.arch == "decoder_only" and cfg.qk_norm:
        return "Qwen3ForCausalLM", QWEN3
    return TARGETS.get(cfg.arch)


def unmapped(cfg: ModelConfig, rules: dict[str, tuple[Any, ...]], free: Collection[str] = FREE) -> list[str]:
    """`model.<field>=<value> (needs ...)` for every field whose value the target cannot represent: a field in
    `rules` maps at the values listed there, one in `free` at any value, any other at its default only."""
    defaults = ModelConfig()
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if rules.get(f.name) is ANY:
            continue
        if f.name in rules:
            allowed = rules[f.name]
        elif f.name in free:
            continue
        else:
            allowed = (getattr(defaults, f.name),)
        if value not in allowed:
            out.append(f"model.{f.name}={value!r} (needs {' or '.join(repr(a) for a in allowed)})")
    return out


def hf_refused(cfg: ModelConfig) -> str | None:
    """Why the Hugging Face export cannot write this variant (every field that does not map), or None."""
    if target(cfg) is None:
        return f"model.arch={cfg.arch} has no Hugging Face export (decoder_only -> Llama, Qwen3 or GPT-2, " \
               "encoder_decoder -> Marian)"
    name, rules = target(cfg)
    bad = unmapped(cfg, rules)
    return f"this variant does not map onto {name}: " + "; ".join(bad) if bad else None


def export_hf(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's model and tokenizer to `out_dir` as a Hugging Face model folder."""
    from safetensors.torch import save_file  # the [hf] extra

    cfg, state, tokenizer, out = export_inputs(ckpt_path, out_dir, hf_refused)
    name = target(cfg)[0]
    write = {"LlamaForCausalLM": llama, "Qwen3ForCausalLM": llama, "GPT2LMHeadModel": gpt2, "MarianMTModel": marian}
    tensors, config = write[name](cfg, state)
    out.mkdir(parents=True, exist_ok=True)
    # one copy each: safetensors refuses tensors that share memory (the splits of qkv_proj, the position tables)
    save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    lm = cfg.arch == "decoder_only"
    # a language model's documents start after an EOS (there is no BOS in its training data): EOS is its BOS
    ids = {"bos_token_id": EOS_ID if lm else BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    config = {"architectures": [name], **config, **ids, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    # generate() with no arguments: greedy, as HF's default and attnlab's for an LM, up to attnlab generate's default
    # length (LM), or up to the position table's end (translation: attnlab's max_len_a * source length + max_len_b
    # has no HF counterpart; without it generate() stops at its 20-token default)
    generation = {**ids, **({"max_new_tokens": GENERATE_MAX_NEW_TOKENS} if lm else
                            {"decoder_start_token_id": BOS_ID, "max_length": cfg.max_seq_len})}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    tokenizer.save(out)
    encode_as_trained(out, lm)  # sources end with </s>; an LM's prompt starts after one, as attnlab generate's
    return out


def export_inputs(ckpt_path: str | Path, out_dir: str | Path, refused: Callable[[ModelConfig], str | None]
                  ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, Path]:
    """What an export reads, checked: the checkpoint's ModelConfig (`refused(cfg)`: why the target cannot take it,
    or None), its model's state dict in fp32 (the `model.` prefix removed), its tokenizer (joint: one vocabulary
    for source and target) and `out_dir`, which must be new or empty. Nothing is written here."""
    ckpt = load_checkpoint(ckpt_path)
    cfg = ModelConfig.from_dict(ckpt["hyper_parameters"]["model"])
    why = refused(cfg)
    if why:
        raise ConfigError(f"{ckpt_path}: {why}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: exists and is not empty; give a new folder")
    tokenizer = load_tokenizer(ckpt_path, ckpt)
    if not tokenizer.joint:
        raise ConfigError(f"{ckpt_path}: its source and target vocabularies differ (data.joint_vocab=false); the "
                          "export needs one")
    state = {k.removeprefix("model."): v.float() for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    return cfg, state, tokenizer, out


def llama(cfg: ModelConfig, s: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """attnlab DecoderOnly -> LlamaForCausalLM (or, with QK-norm, Qwen3ForCausalLM) tensors and config: qkv_proj
    rows are [q; k; v], fc1 rows [gate; up] (SwiGLU: silu(gate) * up), biases alike."""
    q, kv = cfg.n_heads * cfg.d_k, cfg.kv_heads * cfg.d_k
    t = {"model.embed_tokens.weight": s["decoder.embed.weight"], "model.norm.weight": s["decoder.norm.weight"]}
    for i in range(cfg.n_dec_layers):
        a, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        t |= {h + "input_layernorm.weight": s[a + "self_attn_norm.weight"],
              h + "post_attention_layernorm.weight": s[a + "ffn_norm.weight"]}
        for kind in ("weight", "bias") if cfg.attn_bias else ("weight",):
            t |= dict(zip((h + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                          s[a + f"self_attn.qkv_proj.{kind}"].split([q, kv, kv]), strict=True))
            t[h + f"self_attn.o_proj.{kind}"] = s[a + f"self_attn.out_proj.{kind}"]
        for kind in ("weight", "bias") if cfg.ffn_bias else ("weight",):
            gate, up = s[a + f"ffn.fc1.{kind}"].split([cfg.ffn_dim, cfg.ffn_dim])
            t |= {h + f"mlp.gate_proj.{kind}": gate, h + f"mlp.up_proj.{kind}": up,
                  h + f"mlp.down_proj.{kind}": s[a + f"ffn.fc2.{kind}"]}
        if cfg.qk_norm:  # Qwen3's q_norm and k_norm: over each head's head_dim coordinates, before RoPE
            t |= {h + "self_attn.q_norm.weight": s[a + "self_attn.q_norm.weight"],
                  h + "self_attn.k_norm.weight": s[a + "self_attn.k_norm.weight"]}
    tied = cfg.tie_embeddings != "none"
    if not tied:
        t["lm_head.weight"] = s["head.weight"]
    config = {"model_type": "qwen3" if cfg.qk_norm else "llama", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_dec_layers,
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.d_k,
              "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "attention_bias": cfg.attn_bias, "tie_word_embeddings": tied}
    if cfg.qk_norm:
        config["use_sliding_window"] = False  # every layer attends to every earlier position
    else:
        config["mlp_bias"] = cfg.ffn_bias
    return t, config


def gpt2(cfg: ModelConfig, s: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """attnlab DecoderOnly -> GPT2LMHeadModel tensors and config. GPT-2's projections are Conv1D, (in, out): the
    transposes of attnlab's Linear weights; c_attn's columns are [q; k; v] as qkv_proj's rows."""
    t = {"transformer.wte.weight": s["decoder.embed.weight"],
         "transformer.wpe.weight": s["decoder.positions.table.weight"],
         "transformer.ln_f.weight": s["decoder.norm.weight"], "transformer.ln_f.bias": s["decoder.norm.bias"]}
    for i in range(cfg.n_dec_layers):
        a, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in {"self_attn_norm": "ln_1", "ffn_norm": "ln_2"}.items():
            t |= {f"{h}{theirs}.weight": s[f"{a}{ours}.weight"], f"{h}{theirs}.bias": s[f"{a}{ours}.bias"]}
        for ours, theirs in {"self_attn.qkv_proj": "attn.c_attn", "self_attn.out_proj": "attn.c_proj",
                             "ffn.fc1": "mlp.c_fc", "ffn.fc2": "mlp.c_proj"}.items():
            t |= {f"{h}{theirs}.weight": s[f"{a}{ours}.weight"].T, f"{h}{theirs}.bias": s[f"{a}{ours}.bias"]}
    tied = cfg.tie_embeddings != "none"
    if not tied:
        t["lm_head.weight"] = s["head.weight"]
    config = {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.n_dec_layers,
              "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim, "n_positions": cfg.max_seq_len,
              "activation_function": cfg.ffn, "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": tied,
              "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.attn_dropout}
    return t, config


def marian(cfg: ModelConfig, s: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """attnlab EncoderDecoder -> MarianMTModel tensors and config, the residual stream reordered by `perm`."""
    d = cfg.d_model
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))  # attnlab coordinate of Marian's i-th
    q, kv = cfg.n_heads * cfg.d_k, cfg.kv_heads * cfg.d_k

    def reads(w: torch.Tensor) -> torch.Tensor:  # (out, d): input columns from the residual stream
        return w[:, perm]

    def writes(w: torch.Tensor) -> torch.Tensor:  # (d, in) weights or (d,) biases and norms: rows to it
        return w[perm]

    table = s["encoder.embed.weight"]  # (V, d), shared by encoder, decoder and output (tie_embeddings=all)
    positions = sinusoidal_positions(torch.arange(cfg.max_seq_len), d)[:, perm]  # (P, d): [sin | cos]
    t = {"model.shared.weight": reads(table), "final_logits_bias": torch.zeros(1, cfg.vocab_size)}
    for side in ("encoder", "decoder"):
        t[f"model.{side}.embed_positions.weight"] = positions
        for i in range(cfg.n_enc_layers if side == "encoder" else cfg.n_dec_layers):
            a, h = f"{side}.layers.{i}.", f"model.{side}.layers.{i}."
            # (HF attention, its projection) <- (attnlab attention, projection, first row, rows)
            rows = {("self_attn", "q_proj"): ("self_attn", "qkv_proj", 0, q),
                    ("self_attn", "k_proj"): ("self_attn", "qkv_proj", q, kv),
                    ("self_attn", "v_proj"): ("self_attn", "qkv_proj", q + kv, kv)}
            if side == "decoder":  # cross-attention: q_proj, and kv_proj rows [k; v]
                rows |= {("encoder_attn", "q_proj"): ("cross_attn", "q_proj", 0, q),
                         ("encoder_attn", "k_proj"): ("cross_attn", "kv_proj", 0, kv),
                         ("encoder_attn", "v_proj"): ("cross_attn", "kv_proj", kv, kv)}
            for (hf_attn, hf_proj), (attn, proj, start, n) in rows.items():
                t[f"{h}{hf_attn}.{hf_proj}.weight"] = reads(s[f"{a}{attn}.{proj}.weight"][start:start + n])
                t[f"{h}{hf_attn}.{hf_proj}.bias"] = s[f"{a}{attn}.{proj}.bias"][start:start + n]
            for hf_attn, attn in dict.fromkeys((hf_attn, attn) for (hf_attn, _), (attn, *_) in rows.items()):
                t[f"{h}{hf_attn}.out_proj.weight"] = writes(s[f"{a}{attn}.out_proj.weight"])
                t[f"{h}{hf_attn}.out_proj.bias"] = writes(s[f"{a}{attn}.out_proj.bias"])
            norms = {"self_attn_layer_norm": "self_attn_post_norm", "final_layer_norm": "ffn_post_norm"}
            if side == "decoder":
                norms["encoder_attn_layer_norm"] = "cross_attn_post_norm"
            for hf_norm, our_norm in norms.items():
                t[f"{h}{hf_norm}.weight"] = writes(s[f"{a}{our_norm}.weight"])
                t[f"{h}{hf_norm}.bias"] = writes(s[f"{a}{our_norm}.bias"])
            t[h + "fc1.weight"], t[h + "fc1.bias"] = reads(s[a + "ffn.fc1.weight"]), s[a + "ffn.fc1.bias"]
            t[h + "fc2.weight"], t[h + "fc2.bias"] = writes(s[a + "ffn.fc2.weight"]), writes(s[a + "ffn.fc2.bias"])
    config = {"model_type": "marian", "vocab_size": cfg.vocab_size, "decoder_vocab_size": cfg.vocab_size,
              "d_model": d, "encoder_layers": cfg.n_enc_layers, "decoder_layers": cfg.n_dec_layers,
              "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
              "encoder_ffn_dim": cfg.ffn_dim, "decoder_ffn_dim": cfg.ffn_dim, "activation_function": cfg.ffn,
              "max_position_embeddings": cfg.max_seq_len, "scale_embedding": cfg.scale_embeddings,
              "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
              "decoder_start_token_id": BOS_ID, "forced_eos_token_id": None,
              "dropout": cfg.dropout, "attention_dropout": cfg.attn_dropout, "activation_dropout": 0.0}
    return t, config
