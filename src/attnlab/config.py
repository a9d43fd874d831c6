"""Typed, frozen configs. One `ModelConfig` drives every Transformer variant.

Every field is a plain string, bool or number, so the YAML of a run says exactly what ran and
round-trips exactly. Invalid combinations raise `ConfigError` in `__post_init__`, naming the fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import math
import re
import tokenize
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .models.tables import ACTIVATIONS, NORMS


class ConfigError(ValueError):
    """A config value or combination that cannot run. The message names the key(s) at fault."""


# The valid values of each string-valued ablation axis; `one_of` error messages list them. The norms and FFN
# activations are live views of the model's own tables (attnlab.models.tables): an entry added there is a choice.
CHOICES: dict[str, Collection[str]] = {
    "arch": ("encoder_decoder", "decoder_only", "encoder_only"),
    "norm": NORMS.keys(),
    "norm_position": ("post", "pre", "sandwich"),
    "ffn": ACTIVATIONS.keys(),
    "block": ("serial", "parallel"),
    "position": ("sinusoidal", "learned", "rope", "alibi", "none"),
    "tie_embeddings": ("none", "decoder", "all"),
    "attention_backend": ("sdpa", "flash_attn", "eager"),
    "init": ("xavier", "normal"),
}


class StrictConfig:
    """Strict dict/YAML loading shared by every config dataclass: unknown keys and wrong types are errors."""

    prefix: typing.ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str | None = None):
        return from_dict(cls, d, path or cls.prefix)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path):
        return cls.from_dict(load_yaml(text_or_path))

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ModelConfig(StrictConfig):
    """Architecture of one model. Defaults are the 2017 base Transformer (Vaswani et al., arXiv:1706.03762)."""

    prefix: typing.ClassVar[str] = "model"

    arch: str = "encoder_decoder"  # encoder_decoder (translation), decoder_only (LM) or encoder_only
    vocab_size: int = 32000  # target vocabulary (and source too when src_vocab_size is 0)
    src_vocab_size: int = 0  # 0 = same as vocab_size (joint vocabulary)
    d_model: int = 512  # width of the residual stream
    n_heads: int = 8  # attention heads (query heads)
    n_kv_heads: int = 0  # 0 = n_heads (MHA); 1 = MQA (Shazeer 2019); in between = GQA (Ainslie et al. 2023)
    head_dim: int = 0  # d_k of a head (queries, keys); 0 = d_model / n_heads. Set apart as in Qwen3, Gemma
    v_head_dim: int = 0  # d_v of a head (values); 0 = d_k. Vaswani et al. Table 3 (B) varies d_k alone
    n_enc_layers: int = 6  # used by encoder_decoder and encoder_only
    n_dec_layers: int = 6  # used by encoder_decoder and decoder_only
    d_ff: int = 0  # 0 = derived: 4*d for relu/gelu, 8/3*d rounded up to ffn_multiple_of for gated FFNs
    ffn_multiple_of: int = 256  # a derived gated-FFN width is rounded up to a multiple of this
    max_seq_len: int = 1024  # size of a learned position table; positions beyond it are an error
    norm: str = "layernorm"  # layernorm (Ba et al. 2016) or rmsnorm (Zhang & Sennrich 2019)
    norm_position: str = "post"  # post (Vaswani 2017), pre (Xiong 2020) or sandwich (Ding 2021)
    norm_eps: float = 1e-5  # epsilon inside every norm
    ffn: str = "relu"  # FFN activation; reglu, geglu, swiglu are gated (Shazeer 2020)
    attn_bias: bool = True  # biases in the attention projections
    ffn_bias: bool = True  # biases in the FFN projections
    norm_bias: bool = True  # LayerNorm's additive bias; RMSNorm has none by definition
    block: str = "serial"  # serial (attention then FFN) or parallel (both from one input: GPT-J, PaLM)
    qk_norm: bool = False  # normalise each head's queries and keys (Dehghani et al. 2023)
    position: str = "sinusoidal"  # sinusoidal, learned, rope (Su 2021), alibi (Press 2022) or none
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_fraction: float = 1.0  # share of each head's dims that rotate (GPT-NeoX rotary_pct)
    tie_embeddings: str = "all"  # none, decoder (decoder input = output table) or all (source, target, output)
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (Vaswani 2017)
    embed_norm: bool = False  # a norm right after the embeddings (+ positions), before the blocks (BERT, BLOOM)
    dropout: float = 0.1  # residual and embedding dropout
    attn_dropout: float = 0.0  # dropout on attention probabilities
    logit_softcap: float = 0.0  # 0 = off; else logits = c * tanh(logits / c) (Gemma 2)
    attn_softcap: float = 0.0  # 0 = off; else scores = c * tanh(scores / c) (Gemma 2)
    z_loss: float = 0.0  # coefficient of alpha * log(Z)^2 (PaLM); applied by the training loss
    attention_backend: str = "sdpa"  # sdpa (PyTorch), flash_attn (the flash-attn package) or eager
    init: str = "xavier"  # xavier (fairseq) or normal (GPT-2 style, init_std)
    init_std: float = 0.02  # std of normal init (init="normal")
    pad_id: int = 0  # padding token id (set from the tokenizer by fit)

    def __post_init__(self) -> None:
        check_types(self)
        for key, valid in CHOICES.items():
            one_of(key, getattr(self, key), valid)
        positive = ["vocab_size", "d_model", "n_heads", "max_seq_len", "ffn_multiple_of"]
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be > 0")
        for key in ["src_vocab_size", "n_kv_heads", "head_dim", "v_head_dim", "d_ff", "n_enc_layers", "n_dec_layers",
                    "pad_id"]:
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 0")
        for key in ["norm_eps", "rope_theta"]:
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be > 0")
        for key in ["dropout", "attn_dropout"]:
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ["logit_softcap", "attn_softcap", "z_loss", "init_std"]:
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 0")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads} "
                              "(or set model.head_dim)")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")
        if self.arch in ("encoder_decoder", "encoder_only") and self.n_enc_layers < 1:
            raise ConfigError(f"model.arch={self.arch} needs model.n_enc_layers >= 1")
        if self.arch in ("encoder_decoder", "decoder_only") and self.n_dec_layers < 1:
            raise ConfigError(f"model.arch={self.arch} needs model.n_dec_layers >= 1")
        for key in ["vocab_size", "src_vocab_size"]:
            if self.pad_id >= (getattr(self, key) or self.vocab_size):
                raise ConfigError(f"model.pad_id={self.pad_id} is outside the vocabulary (model.{key}="
                                  f"{getattr(self, key)})")
        shared = self.tie_embeddings == "all" and self.arch == "encoder_decoder"
        if shared and self.source_vocab_size != self.vocab_size:
            raise ConfigError(
                f"model.tie_embeddings=all shares one table, but model.src_vocab_size={self.src_vocab_size} "
                f"differs from model.vocab_size={self.vocab_size}"
            )
        if not 0.0 < self.rope_fraction <= 1.0:
            raise ConfigError(f"model.rope_fraction={self.rope_fraction} must be in (0, 1]")
        if self.position == "rope" and (self.rotary_dim % 2 or self.rotary_dim < 2):
            raise ConfigError(  # a rotary dimension of 0 would rotate nothing: no positions at all
                f"model.position=rope needs an even rotary dimension of at least 2; head dimension {self.d_k} with "
                f"model.rope_fraction={self.rope_fraction} gives {self.rotary_dim}"
            )
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model.position=sinusoidal needs an even model.d_model, got {self.d_model}")
        if self.attn_softcap > 0 and self.attention_backend == "sdpa":
            raise ConfigError(
                "model.attn_softcap needs model.attention_backend=eager or flash_attn: "
                "PyTorch SDPA cannot modify scores before the softmax"
            )
        if self.d_v != self.d_k and self.attention_backend == "flash_attn":
            raise ConfigError(f"model.v_head_dim={self.v_head_dim} differs from the key size {self.d_k}: flash-attn "
                              "needs one head size for queries, keys and values (model.attention_backend=sdpa)")
        if self.position == "alibi" and self.attention_backend == "flash_attn":
            raise ConfigError("model.position=alibi is not supported with model.attention_backend=flash_attn")

    # ----- derived values (no state: computed from the fields) -----
    @property
    def d_k(self) -> int:
        """d_k of each head (queries and keys): model.head_dim, or d_model / n_heads when it is 0."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def d_v(self) -> int:
        """d_v of each head (values): model.v_head_dim, or d_k when it is 0."""
        return self.v_head_dim or self.d_k

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.d_k * self.rope_fraction)

    @property
    def source_vocab_size(self) -> int:
        return self.src_vocab_size or self.vocab_size

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.ffn].gated

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the FFN. Gated FFNs keep parameters ~equal to 4d by using 8/3 d (Shazeer 2020)."""
        if self.d_ff:
            return self.d_ff
        if not self.gated:
            return 4 * self.d_model
        hidden = int(8 * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)

    @property
    def norm_slots(self) -> tuple[bool, bool, bool]:
        """Which of a block's norm slots cfg.norm_position fills: before each sublayer f (pre, sandwich), on f's
        output (sandwich), after the residual sum (post): the f_norm, f_out_norm and f_post_norm of models/block.py."""
        return (self.norm_position in ("pre", "sandwich"), self.norm_position == "sandwich",
                self.norm_position == "post")

    @property
    def final_norm(self) -> bool:
        """Pre- and sandwich-norm stacks end in a norm; a post-norm stack's last sublayer already normalised."""
        return self.norm_position != "post"


# ---------------------------------------------------------------------------------------------
# Strict dict <-> dataclass helpers, shared by every config class.
# ---------------------------------------------------------------------------------------------
T = TypeVar("T")


def one_of(key: str, value: Any, valid: Collection[str], prefix: str = "model") -> None:
    if value not in valid:
        raise ConfigError(f"{prefix}.{key}={value!r} is not one of: {', '.join(valid)}")


def type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # an int is a valid float (YAML writes 1.0 as 1.0, but users write 1)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(type_ok(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_types(obj: Any, prefix: str | None = None) -> None:
    """Raise ConfigError naming the field when a dataclass field holds a value of the wrong type."""
    prefix = prefix or getattr(obj, "prefix", "") or type(obj).__name__.lower()
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        if not type_ok(value, hints[f.name]):
            raise ConfigError(
                f"{prefix}.{f.name}={value!r} has type {type(value).__name__}, expected {type_name(hints[f.name])}"
            )
    # ints given for float fields become floats, so a config compares and serialises the same either way
    for f in fields(obj):
        value = getattr(obj, f.name)
        if hints[f.name] is float and isinstance(value, int):
            object.__setattr__(obj, f.name, float(value))


def from_dict(cls: type[T], d: dict[str, Any], path: str) -> T:
    """Build dataclass `cls` from `d`, rejecting unknown keys (with close matches) and wrong types."""
    check_mapping(cls, d, path)
    return cls(**d)


def check_mapping(cls: type, d: dict[str, Any], path: str) -> None:
    """ConfigError for a key of `d` that names no field of dataclass `cls` (with close matches) or a value of the
    wrong type; `path` prefixes the keys (`model`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(d).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = [k for k in d if k not in names]
    if unknown:
        hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        detail = ", ".join(f"{path}.{k}" + (f" (did you mean {path}.{h[0]}?)" if h else "") for k, h in hints.items())
        raise ConfigError(f"unknown config key(s): {detail}")
    hints_t = typing.get_type_hints(cls)
    for k, v in d.items():
        if not type_ok(v, hints_t[k]):
            raise ConfigError(f"{path}.{k}={v!r} has type {type(v).__name__}, expected {type_name(hints_t[k])}")
        if isinstance(v, float) and not math.isfinite(v):  # YAML's .inf, .nan, 1e400: no field means either
            raise ConfigError(f"{path}.{k}={v!r} must be a finite number")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its one-line description: the comment at the end of the field's line in the class source,
    the one place a description is written (`attnlab fit --help` lists them; tests require one per field)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped: help shows types and defaults only
        return {}
    docs: dict[str, str] = {}
    line_start: tokenize.TokenInfo | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.NL):
            line_start = None
        elif line_start is None and tok.type not in (tokenize.INDENT, tokenize.DEDENT):
            line_start = tok
        if tok.type == tokenize.COMMENT and line_start is not None and line_start.type == tokenize.NAME:
            docs.setdefault(line_start.string, tok.string.lstrip("#").strip())
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in docs.items() if k in names}


def type_name(tp: Any) -> str:
    """`int`, `str | list[str]`: a type hint as a user reads it."""
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


class YAMLLoader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads `1e-6` and `3E+4` as the floats YAML 1.2 says they are: PyYAML follows
    YAML 1.1, which wants a dot (`1.0e-6`) and otherwise gives the string '1e-6'."""


YAMLLoader.add_implicit_resolver(  # a copy of SafeLoader's resolvers, with this one added (PyYAML copies on write)
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def parse_yaml(text: str) -> Any:
    """YAML text as Python values (YAMLLoader: safe, and `1e-6` is a float)."""
    return yaml.load(text, Loader=YAMLLoader)  # noqa: S506 (YAMLLoader is a SafeLoader)


def load_yaml(text_or_path: str | Path) -> dict[str, Any]:
    """Parse YAML from a path or a string; errors name the file."""
    p = Path(text_or_path) if not (isinstance(text_or_path, str) and "\n" in text_or_path) else None
    if p is not None and (p.suffix in (".yaml", ".yml", ".json") or p.exists() or ":" not in str(text_or_path)):
        if not p.exists():  # a path, or one line that is no YAML mapping: a file name
            raise ConfigError(f"config file not found: {p}")
        try:
            source, text = str(p), p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); a recipe is a UTF-8 YAML file") from None
    else:
        source, text = "<string>", str(text_or_path)
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------
# Optimisation, training and decoding
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimConfig(StrictConfig):
    """AdamW and the learning-rate schedule. Defaults: the paper's Adam and Noam schedule."""

    prefix: typing.ClassVar[str] = "optim"

    lr: float = 1.0  # peak lr; for schedule=noam the scale factor of d^-0.5 * min(s^-0.5, s * w^-1.5)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.98  # AdamW beta2 (the paper's 0.98)
    eps: float = 1e-9  # AdamW epsilon (the paper's 1e-9)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    decay_norms_biases_embeddings: bool = False  # False: those parameters get no weight decay
    schedule: str = "noam"  # noam | inverse_sqrt | cosine | wsd | constant
    warmup_steps: int = 4000  # linear warmup steps of the schedule
    min_lr_ratio: float = 0.0  # floor of cosine and wsd, as a fraction of lr
    decay_fraction: float = 0.2  # wsd: share of max_steps spent decaying
    max_steps: int = 100000  # the schedule's horizon (cosine, wsd)
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    accumulate: int = 1  # gradient accumulation steps
    label_smoothing: float = 0.1  # label smoothing of the training loss (the paper's 0.1)

    def __post_init__(self) -> None:
        check_types(self, "optim")
        one_of("schedule", self.schedule, ("noam", "inverse_sqrt", "cosine", "wsd", "constant"), "optim")
        for key in ("lr", "eps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be > 0")
        for key in ("beta1", "beta2", "label_smoothing"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ("min_lr_ratio", "decay_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1]")
        for key in ("weight_decay", "grad_clip", "warmup_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 0")
        for key in ("max_steps", "accumulate"):
            if getattr(self, key) < 1:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 1")
        if self.schedule == "noam" and self.warmup_steps < 1:
            raise ConfigError("optim.schedule=noam needs optim.warmup_steps >= 1")


@dataclass(frozen=True)
class DecodeConfig(StrictConfig):
    """Decoding for validation BLEU, test and `attnlab translate`. Defaults: the paper's beam 4, alpha 0.6."""

    prefix: typing.ClassVar[str] = "decode"

    beam: int = 4  # beam size for test and translate (1 = greedy)
    len_penalty: float = 0.6  # alpha
    penalty: str = "gnmt"  # gnmt: ((5 + len) / 6)^alpha (Wu et al. 2016); fairseq: len^alpha
    max_len_a: float = 1.0  # max output length = a * source length + b
    max_len_b: int = 50  # see max_len_a
    val_beam: int = 1  # beam during validation (1 = greedy, cheaper)
    val_sentences: int = 500  # about this many sentences, every k-th of the split, decoded for BLEU/chrF; 0 = none
    batch_sentences: int = 64  # at most this many sentences per decoding batch on CUDA (test, translate); a CPU
    # batches by tokens, at most 1,024 rows of sentences x beam (evaluate.batch_sizes)
    # sorted by length, the last batch gathers the long tail (on the demo's test split, 22 sentences padded to 670)
    max_tokens: int = 8192  # and at most this many source tokens (padding counted: n * longest; on a CPU at most
    # 4,096); 0 = no limit
    average_last: int = 5  # checkpoints averaged for the final model (Vaswani et al. average the last 5)
    # (best_window.py: a short run on a small corpus is past its best by its end)
    average_at: str = "last"  # last: the last average_last checkpoints; best: those up to the lowest val loss
    engine: str = "attnlab"  # what decodes test, translate, demo, the final evaluation: attnlab | ctranslate2
    # On an H100 (bench/RESULTS.md, 2026-11-26): 4.1x HF Marian greedy and 2.6x beam 4, against 1.35x and 1.26x
    # without; tests/test_gpu.py checks its tokens inside the module under bf16 autocast. Ignored on a CPU, for ALiBi
    # and for attention_backend flash_attn (those decode the default way).
    cuda_graph: bool = True  # on CUDA, every decoder step one CUDA graph (decode.py graph=True): the same tokens

    def __post_init__(self) -> None:
        check_types(self, "decode")
        one_of("penalty", self.penalty, ("gnmt", "fairseq"), "decode")
        one_of("engine", self.engine, ("attnlab", "ctranslate2"), "decode")
        one_of("average_at", self.average_at, ("last", "best"), "decode")
        for key in ("beam", "val_beam", "batch_sentences", "average_last"):
            if getattr(self, key) < 1:
                raise ConfigError(f"decode.{key}={getattr(self, key)} must be >= 1")
        for key in ("len_penalty", "max_len_a", "max_len_b", "val_sentences", "max_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"decode.{key}={getattr(self, key)} must be >= 0")
