"""CTranslate2 (the `ctranslate2` extra): `attnlab export --format ctranslate2` writes a model folder for fast CPU
and GPU inference with `ctranslate2.Translator` (translation) or `ctranslate2.Generator` (language models), and
`decode.engine: ctranslate2` (`--engine ctranslate2` of test, validate, translate and demo; the ablation's final
evaluation) decodes with it: the checkpoint is converted once, into `<run dir>/ct2/<checkpoint>-<its SHA-256>/`,
and every later decoding of the same checkpoint file loads that folder.

The model is written as CTranslate2's own Transformer spec (`model_spec`), built from the checkpoint's ModelConfig
and weights, not through a Hugging Face model: so every variant CTranslate2's Transformer can represent converts
(post-, pre- and sandwich-norm; LayerNorm, with or without bias, or RMSNorm; ReLU, GELU and the GLU variants;
biases on or off; sinusoidal, learned, rotary or no positions; MHA/GQA/MQA and head_dim; the embedding norm;
logit soft-capping; and for a language model ALiBi, QK-norm and the parallel pre-norm block), and any other is
refused with the list of fields at fault (`refusals`). attnlab keeps `<pad>` at id 0 and starts the decoder from
`<s>`; the vocabulary is written whole, in id order. The tokenizer files go into the folder too, so
`transformers.AutoTokenizer.from_pretrained(folder)` gives the tokens CTranslate2 takes (a source ends with
`</s>`; an LM's tokenizer starts every prompt with `</s>`, as attnlab generate does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from .checkpoints import run_dir_of
from .config import ConfigError, DecodeConfig, ModelConfig
from .data.tokenizer import BOS, EOS, UNK, encode_as_trained
from .export import export_inputs, unmapped
from .models.layers import sinusoidal_positions
from .models.tables import ACTIVATIONS

log = logging.getLogger("attnlab")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _ct2(what: str):
    """The ctranslate2 module, or a ConfigError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ConfigError(f"{what} needs CTranslate2: pip install 'attnlab[ctranslate2]'") from None
    return ctranslate2


def export_ctranslate2(ckpt_path: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Write the checkpoint as a CTranslate2 model folder (with its tokenizer) to `out_dir`."""
    ct2 = _ct2("attnlab export --format ctranslate2")
    cfg, state, tokenizer, out = export_inputs(ckpt_path, out_dir, ct2_refused)
    tokens = [tokenizer.tgt.id_to_token(i) or f"<extra_id_{i}>" for i in range(cfg.vocab_size)]  # by id
    spec = model_spec(ct2.specs, cfg, state, tokens)
    spec.validate()
    spec.optimize(quantization=quantization)
    with tempfile.TemporaryDirectory(prefix="attnlab-ct2-") as tmp:
        tokenizer.save(tmp)
        encode_as_trained(tmp, cfg.arch == "decoder_only")  # sources end with </s>; an LM's prompt starts after one
        out.mkdir(parents=True, exist_ok=True)
        spec.save(str(out))
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tmp) / name, out / name)
    return out


# ---------------------------------------------------------------------------------------------- the spec
# ModelConfig fields this module maps, whatever their value (some values are refused by `refusals`); any other
# field (one added to ModelConfig later) maps only at its default, so a new variant is never converted wrong
MAPPED = {"arch", "vocab_size", "src_vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "v_head_dim",
          "n_enc_layers", "n_dec_layers", "d_ff", "ffn_multiple_of", "max_seq_len", "norm", "norm_position",
          "norm_eps", "ffn", "attn_bias", "ffn_bias", "norm_bias", "block", "qk_norm", "position", "rope_theta",
          "rope_fraction", "tie_embeddings", "scale_embeddings", "embed_norm", "dropout", "attn_dropout",
          "logit_softcap", "attn_softcap", "z_loss", "attention_backend", "init", "init_std", "pad_id"}


def refusals(cfg: ModelConfig) -> list[str]:
    """`model.<field>=<value> (why)` for every field whose value CTranslate2's Transformer cannot represent."""
    out = []
    if cfg.arch == "encoder_only":
        out.append("model.arch='encoder_only' (needs 'encoder_decoder' or 'decoder_only': CTranslate2 decodes)")
    if cfg.v_head_dim not in (0, cfg.d_k):
        out.append(f"model.v_head_dim={cfg.v_head_dim} (needs 0: one head size for keys and values)")
    if cfg.attn_softcap:
        out.append(f"model.attn_softcap={cfg.attn_softcap} (needs 0.0: no soft-capping of attention scores)")
    if cfg.block == "parallel" and (cfg.arch != "decoder_only" or cfg.norm_position != "pre"):
        out.append("model.block='parallel' (needs 'serial': CTranslate2's parallel block is GPT-J's, decoder-only "
                   "and pre-norm)")
    if cfg.qk_norm and cfg.arch == "encoder_decoder":  # measured: its cross-attention's logits differ by ~1 nat
        out.append("model.qk_norm=True (needs False for a translation model: CTranslate2 does not normalise the "
                   "cross-attention's queries and keys)")
    if cfg.position == "alibi" and cfg.arch != "decoder_only":
        out.append("model.position='alibi' (needs 'sinusoidal', 'learned', 'rope' or 'none': ALiBi is "
                   "decoder-only there)")
    return out + unmapped(cfg, {}, free=MAPPED)  # a field added to ModelConfig later: at its default only


def ct2_refused(cfg: ModelConfig) -> str | None:
    """Why CTranslate2 cannot take this variant (every field at fault), or None."""
    bad = refusals(cfg)
    return "CTranslate2's Transformer cannot represent this variant: " + "; ".join(bad) if bad else None


def model_spec(specs, cfg: ModelConfig, s: dict[str, torch.Tensor], tokens: list[str]):
    """The CTranslate2 model spec of an attnlab model: `specs` is ctranslate2.specs, `s` the model's state dict
    (fp32), `tokens` the joint vocabulary by id. TransformerSpec for translation, TransformerDecoderModelSpec
    for a language model; the caller has checked `refusals`."""
    common = specs.common_spec
    act = {"relu": common.Activation.RELU, "gelu": common.Activation.GELU, "reglu": common.Activation.RELU,
           "geglu": common.Activation.GELU, "swiglu": common.Activation.SWISH}[cfg.ffn]
    rms, sandwich, lm = cfg.norm == "rmsnorm", cfg.norm_position == "sandwich", cfg.arch == "decoder_only"
    kw = dict(pre_norm=cfg.norm_position != "post", activation=act, ffn_glu=ACTIVATIONS[cfg.ffn].gated,
              rms_norm=rms, layernorm_embedding=cfg.embed_norm, head_dim=cfg.d_k, qk_norm=cfg.qk_norm,
              num_heads_kv=cfg.kv_heads if cfg.kv_heads != cfg.n_heads else None, pre_post_layer_norm=sandwich)
    if cfg.position == "rope":  # attnlab rotates the two halves of the first rotary_dim dims (GPT-NeoX style)
        kw |= dict(rotary_dim=cfg.rotary_dim, rotary_interleave=False, rotary_base=cfg.rope_theta)
    dec_kw = dict(alibi=cfg.position == "alibi", parallel_residual=cfg.block == "parallel",
                  with_encoder_attention=not lm, external_pre_post_encoder_layers=sandwich and not lm)

    def tensor(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().contiguous().numpy()

    def norm(spec, name: str) -> None:  # a LayerNormSpec <- attnlab's norm `name`
        spec.gamma = tensor(s[name + ".weight"])
        if not rms:
            bias = s.get(name + ".bias")
            spec.beta = tensor(bias if bias is not None else torch.zeros_like(s[name + ".weight"]))

    def linear(spec, name: str) -> None:
        spec.weight = tensor(s[name + ".weight"])
        if name + ".bias" in s:
            spec.bias = tensor(s[name + ".bias"])

    def attention(spec, name: str, cross: bool) -> None:  # linear: [qkv, out] or, cross, [q, kv, out]
        parts = ("q_proj", "kv_proj", "out_proj") if cross else ("qkv_proj", "out_proj")
        for lin, part in zip(spec.linear, parts, strict=True):
            linear(lin, f"{name}.{part}")
        if cfg.qk_norm:
            spec.q_norm, spec.k_norm = common.LayerNormSpec(rms_norm=rms), common.LayerNormSpec(rms_norm=rms)
            norm(spec.q_norm, name + ".q_norm")
            norm(spec.k_norm, name + ".k_norm")

    def layer(spec, a: str, cross: bool) -> None:
        attention(spec.self_attention, a + "self_attn", cross=False)
        if cross:
            attention(spec.attention, a + "cross_attn", cross=True)
        ffn = spec.ffn
        if ACTIVATIONS[cfg.ffn].gated:
            gate, up = s[a + "ffn.fc1.weight"].chunk(2)  # rows [gate; up]: fn(x W_gate) * (x W_up)
            ffn.linear_0.weight, ffn.linear_0_noact.weight = tensor(gate), tensor(up)
            if a + "ffn.fc1.bias" in s:
                gate_b, up_b = s[a + "ffn.fc1.bias"].chunk(2)
                ffn.linear_0.bias, ffn.linear_0_noact.bias = tensor(gate_b), tensor(up_b)
        else:
            linear(ffn.linear_0, a + "ffn.fc1")
        linear(ffn.linear_1, a + "ffn.fc2")
        if sandwich:  # Gemma's four norms: before and on the output of each sublayer
            norms = {"input_layer_norm": "self_attn_norm", "post_attention_layer_norm": "self_attn_out_norm",
                     "pre_feedforward_layer_norm": "ffn_norm", "post_feedforward_layer_norm": "ffn_out_norm"}
            if cross:
                norms |= {"external_pre_encoder_attention_layer_norm": "cross_attn_norm",
                          "external_post_encoder_attention_layer_norm": "cross_attn_out_norm"}
            for theirs, ours in norms.items():
                norm(getattr(spec, theirs), a + ours)
        elif cfg.block == "parallel":  # x + attn(n1(x)) + ffn(n2(x)): GPT-NeoX's two norms
            spec.input_layer_norm = common.LayerNormSpec(rms_norm=rms)
            spec.post_attention_layer_norm = common.LayerNormSpec(rms_norm=rms)
            norm(spec.input_layer_norm, a + "self_attn_norm")
            norm(spec.post_attention_layer_norm, a + "ffn_norm")
        else:  # one norm a sublayer: before it (pre) or after the residual sum (post)
            where = "_norm" if cfg.norm_position == "pre" else "_post_norm"
            norm(spec.self_attention.layer_norm, f"{a}self_attn{where}")
            if cross:
                norm(spec.attention.layer_norm, f"{a}cross_attn{where}")
            norm(ffn.layer_norm, f"{a}ffn{where}")

    def stack(spec, name: str, embeddings, cross: bool) -> None:
        embeddings.weight = tensor(s[name + ".embed.weight"])
        spec.scale_embeddings = cfg.scale_embeddings
        if cfg.position in ("sinusoidal", "learned", "none"):
            rows = torch.arange(cfg.max_seq_len)
            table = {"sinusoidal": lambda: sinusoidal_positions(rows, cfg.d_model),
                     "learned": lambda: s[name + ".positions.table.weight"],
                     "none": lambda: torch.zeros(cfg.max_seq_len, cfg.d_model)}[cfg.position]()  # (P, d)
            spec.position_encodings.encodings = tensor(table)
        if cfg.embed_norm:
            norm(spec.layernorm_embedding, name + ".embed_norm")
        if cfg.final_norm:
            norm(spec.layer_norm, name + ".norm")
        for i, layer_spec in enumerate(spec.layer):
            layer(layer_spec, f"{name}.layers.{i}.", cross)

    decoder = specs.TransformerDecoderSpec(cfg.n_dec_layers, cfg.n_heads, **kw, **dec_kw)
    stack(decoder, "decoder", decoder.embeddings, cross=not lm)
    decoder.projection.weight = tensor(s["head.weight"] if "head.weight" in s else s["decoder.embed.weight"])
    if cfg.logit_softcap:
        decoder.final_logit_softcapping = np.float32(cfg.logit_softcap)
    if lm:
        spec = specs.TransformerDecoderModelSpec(decoder)
        spec.register_vocabulary(tokens)
        spec.config.bos_token = EOS  # an LM's text starts after an EOS (export.py)
    else:
        encoder = specs.TransformerEncoderSpec(cfg.n_enc_layers, cfg.n_heads, **kw)
        stack(encoder, "encoder", encoder.embeddings[0], cross=False)
        spec = specs.TransformerSpec(encoder, decoder)
        spec.register_source_vocabulary(tokens)
        spec.register_target_vocabulary(tokens)
        spec.config.bos_token, spec.config.decoder_start_token = BOS, BOS
        spec.config.add_source_bos = spec.config.add_source_eos = False  # sources come with their </s>
    spec.config.eos_token, spec.config.unk_token = EOS, UNK
    spec.config.layer_norm_epsilon = cfg.norm_eps
    return spec


# ---------------------------------------------------------------------------------------------- the engine
_CONVERTED: dict[tuple[str, int, int], Path] = {}  # (checkpoint file, size, mtime) -> its folder: hashed once


def converted(ckpt_path: str | Path) -> Path:
    """The CTranslate2 folder of this checkpoint file, converted on first use: `<run dir>/ct2/<stem>-<SHA-256 of
    the file, 12 digits>/` (a checkpoint rewritten in place, as averaged_lastN.ckpt is, gets a new folder). Written
    beside and renamed into place, so a killed conversion leaves nothing half-made and two processes that convert
    at once both end with the one folder. A file already hashed in this process, unchanged since (size and
    modification time), is not read again."""
    ckpt_path = Path(ckpt_path).resolve()
    stat = ckpt_path.stat()
    seen = (str(ckpt_path), stat.st_size, stat.st_mtime_ns)  # the file as hashed last time in this process
    folder = _CONVERTED.get(seen)
    if folder is not None and (folder / "model.bin").is_file():
        return folder
    digest = hashlib.sha256()
    with open(ckpt_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    folder = run_dir_of(ckpt_path) / "ct2" / f"{ckpt_path.stem}-{digest.hexdigest()[:12]}"
    _CONVERTED[seen] = folder
    if (folder / "model.bin").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        try:
            export_ctranslate2(ckpt_path, tmp / "model")
        except ConfigError as e:
            raise ConfigError(f"decode.engine=ctranslate2 cannot decode it (use decode.engine=attnlab): {e}") from None
        try:
            os.rename(tmp / "model", folder)
        except OSError:  # another process converted it meanwhile
            if not (folder / "model.bin").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s for CTranslate2 into %s", ckpt_path, folder)
    return folder


def compute_type(dtype: torch.dtype | None) -> str:
    """CTranslate2's compute type for the dtype attnlab would decode in (evaluate.decode_dtype)."""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")  # type: ignore[arg-type]


def vocabulary(folder: Path) -> list[str]:
    """The token of each id: the converter keeps attnlab's vocabulary whole and in order."""
    path = folder / "shared_vocabulary.json"
    if not path.is_file():
        path = folder / "target_vocabulary.json"
    return json.loads(path.read_text(encoding="utf-8"))


def ct2_translate(ckpt_path: str | Path, sources: list[list[int]], batches: list[list[int]], decode: DecodeConfig,
                  beam: int, device: torch.device, dtype: torch.dtype | None,
                  cap: int | None = None, workers: int | None = None) -> list[list[int]]:
    """Decode the token ids of `sources` (each ending in EOS), batch by batch (lists of indices), with
    CTranslate2 on `device`: beam search with `beam` and length penalty decode.len_penalty, at most
    int(max_len_a * source length + max_len_b) tokens and at most `cap`, as attnlab. Returns each sentence's
    output ids without EOS. On a CPU `workers` batches (default: torch's thread count) are decoded at once, each on
    one thread (CTranslate2's inter_threads; intra_threads 1).
    A hypothesis cut at that length is scored without an EOS (attnlab, as fairseq, forces and counts one).
    CTranslate2 normalises a finished hypothesis by len^alpha, fairseq's penalty; with decode.penalty gnmt that
    form is used all the same (a warning says so).

    Each sentence keeps its own maximum length, though CTranslate2 takes one a call, with one call a batch:
    greedy decodes to the batch's largest and cuts each output at its own (a greedy output's prefix does not depend
    on how far it goes on). Beam search decodes to the batch's smallest, asking for all `beam` hypotheses: a search
    that reached that length ends its beams there, with exactly that many tokens (one that ends by itself holds
    fewer, its EOS not counted), and is the same search as with a larger maximum until then. A sentence with such a
    hypothesis among its `beam` best and a larger maximum of its own is decoded again, with the sentences of the
    same maximum (every other sentence's result is the one its own maximum gives). With len_penalty 0
    CTranslate2 stops a search once its best beam ends, a rule that depends on the hypotheses asked for: there,
    one call for each maximum length in the batch."""
    ct2 = _ct2("decode.engine=ctranslate2")
    folder = converted(ckpt_path)
    if beam > 1 and decode.penalty != "fairseq" and decode.len_penalty:
        log.warning("decode.engine=ctranslate2 ranks beams by log p / len^%g (decode.penalty fairseq); this recipe "
                    "says decode.penalty=%s", decode.len_penalty, decode.penalty)
    # On a CPU: torch's thread count as that many batches at once, one thread each. In a process where torch has
    # run on several threads, CTranslate2's own intra-op threads slow it down instead (measured on 2 cores: 2
    # intra threads 232 sent/s greedy, 2 inter threads 556, 1 thread 446; bench/RESULTS.md).
    if workers is None or device.type != "cpu":
        workers = torch.get_num_threads() if device.type == "cpu" else 1
    translator = loaded_translator(ct2, folder, device, compute_type(dtype), workers)
    vocab = vocabulary(folder)
    index = {t: i for i, t in enumerate(vocab)}
    tokens = [[vocab[t] for t in ids] for ids in sources]
    # decode.max_lengths' rule, and its cap (`cap`: decode.position_cap, a learned position table's length)
    limits = [min(int(decode.max_len_a * len(ids) + decode.max_len_b), cap if cap is not None else 1 << 30)
              for ids in sources]
    out: list[list[int]] = [[] for _ in sources]
    exact = beam > 1 and not decode.len_penalty  # one call per maximum length (the docstring)
    calls = []  # (indices, their maximum length): the batches, or each batch's sentences of one maximum length
    for batch in batches:
        if exact:
            calls += [([i for i in batch if limits[i] == n], n) for n in sorted({limits[i] for i in batch})]
        else:
            calls.append((batch, (max if beam == 1 else min)(limits[i] for i in batch)))
    again: dict[int, list[int]] = {}  # maximum length -> the sentences decoded again with it
    n_best = 1 if beam == 1 or exact else beam
    for idx, length, results in _queued(translator, tokens, calls, beam, decode.len_penalty, n_best, ct2):
        for i, r in zip(idx, results, strict=True):
            if length < limits[i] and any(len(h) == length for h in r.hypotheses):
                again.setdefault(limits[i], []).append(i)  # beam search reached the call's maximum: not its own
            else:
                out[i] = [index[t] for t in r.hypotheses[0][: limits[i]]]
    for idx, _, results in _queued(translator, tokens, [(idx, n) for n, idx in sorted(again.items())], beam,
                                   decode.len_penalty, 1, ct2):
        for i, r in zip(idx, results, strict=True):
            out[i] = [index[t] for t in r.hypotheses[0]]
    return out


def _queued(translator, tokens: list[list[str]], calls: list[tuple[list[int], int]], beam: int, len_penalty: float,
            n_best: int, ct2):
    """(indices, maximum length, results) of each call, all queued at once (the translator's workers take them in
    turn)."""
    pending = [(idx, length, translator.translate_batch(
        [tokens[i] for i in idx], beam_size=beam, length_penalty=len_penalty, max_decoding_length=length,
        num_hypotheses=n_best, asynchronous=True)) for idx, length in calls]
    with cuda_libraries(ct2):  # CTranslate2 opens cuBLAS at its first matrix product on a GPU
        for idx, length, results in pending:
            yield idx, length, [r.result() for r in results]


_TRANSLATORS: dict[tuple, object] = {}  # the Translator last loaded, kept for the later calls of this process
_TRANSLATORS_LOCK = threading.Lock()


def loaded_translator(ct2, folder: Path, device: torch.device, compute: str, workers: int):
    """A ctranslate2.Translator of `folder`, loaded at the first call and kept for the next ones with the same
    folder, device, compute type and workers (loading costs more than translating a test split on a GPU). One is
    kept: another model or setting replaces it. Torch's thread count is left as it was (loading a Translator sets
    the calling thread's OpenMP threads, which torch's count is, to its intra_threads: 1)."""
    key = (id(ct2), str(folder), device.type, device.index or 0, compute, workers)
    with _TRANSLATORS_LOCK:
        if key not in _TRANSLATORS:
            _TRANSLATORS.clear()  # its weights go with it
            threads = torch.get_num_threads()
            try:
                with cuda_libraries(ct2):
                    _TRANSLATORS[key] = ct2.Translator(str(folder), device=device.type, device_index=device.index or 0,
                                                       compute_type=compute, inter_threads=workers, intra_threads=1)
            finally:  # loading sets this thread's OpenMP thread count, torch's too, to intra_threads
                torch.set_num_threads(threads)
        return _TRANSLATORS[key]


@contextlib.contextmanager
def cuda_libraries(ct2):
    """Turn CTranslate2's "Library libcublas.so.12 is not found or cannot be loaded" into a ConfigError that says
    what to install: its PyPI wheels open CUDA 12's libraries by name, which a machine with only another CUDA's
    (such as CUDA 13, torch's own there) lacks."""
    try:
        yield
    except RuntimeError as e:
        if "is not found or cannot be loaded" not in str(e):
            raise
        raise ConfigError(
            f"decode.engine=ctranslate2 on a GPU: CTranslate2 {getattr(ct2, '__version__', '?')} says \"{e}\". Its "
            "wheels are built for CUDA 12: pip install nvidia-cublas-cu12 and put that package's lib folder "
            "(site-packages/nvidia/cublas/lib) on LD_LIBRARY_PATH before starting Python, or decode with "
            "decode.engine=attnlab") from e
