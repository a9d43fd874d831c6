"""An experiment: model + data + optim + trainer + decode configs, loaded from a YAML recipe.

A recipe may name a `base:` recipe (a path relative to itself) and override only what differs, as the
demo does with the paper's base recipe. Dotted command-line overrides (`--model.norm rmsnorm`) apply last;
unknown keys anywhere are errors naming the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import (
    ConfigError,
    DecodeConfig,
    ModelConfig,
    OptimConfig,
    StrictConfig,
    check_mapping,
    check_types,
    load_yaml,
    one_of,
    parse_yaml,
)
from .data.config import LOCALE_DIRS, DataConfig
from .lit.fused_loss import FUSED_LOSSES, unsupported

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")  # Lightning's loggers that trainer.loggers names


@dataclass(frozen=True)
class TrainConfig(StrictConfig):
    """The Lightning Trainer and the run directory."""

    prefix: typing.ClassVar[str] = "trainer"

    max_steps: int = 100000  # optimizer steps to train
    max_time_min: float = 0.0  # wall-clock budget in minutes; 0 = none. Stops cleanly with a checkpoint
    val_every: int = 1000  # validate every N optimizer steps
    limit_val_batches: int = 0  # 0 = the whole validation split
    ckpt_every: int = 1000  # checkpoint every N optimizer steps (and at the end)
    val_every_min: float = 0.0  # > 0: validations at least this many minutes apart (val_every stretched to fit)
    ckpt_every_min: float = 0.0  # > 0: checkpoints at least this many minutes apart (ckpt_every stretched to fit)
    keep_checkpoints: int = 5  # step checkpoints kept besides last.ckpt (at least decode.average_last)
    log_every: int = 50  # log metrics (and a progress line when not on a terminal) every N steps
    precision: str = "auto"  # auto: bf16-mixed on GPU, 32-true on CPU
    accelerator: str = "auto"  # auto | cpu | gpu (Lightning's accelerator)
    devices: int = 1  # -1: all visible devices
    num_nodes: int = 1  # machines (SLURM jobs take it from SLURM)
    strategy: str = "auto"  # auto | ddp | fsdp
    compile: bool = False  # torch.compile each block
    loss_chunk: int = 0  # > 0: training loss without the batch's logits, this many tokens at a time; 0 = plain
    # auto: on CUDA liger, else cce, where installed and able to compute the loss (it then takes precedence over
    # loss_chunk); elsewhere off, the logits path (plain, or chunked by loss_chunk)
    fused_loss: str = "auto"  # the training loss by a fused kernel library (gpu extra): auto | liger | cce | off
    # checkpoint files written by a background thread from a copy of the state taken at the step (checkpoint_io.py), so
    # that training goes on while they are written: auto = on CUDA (not FSDP), foreground elsewhere
    checkpoint_writes: str = "auto"  # auto | background | foreground
    seed: int = 1  # seed of initialisation, dropout and batch order
    deterministic: bool = False  # torch's deterministic algorithms: a GPU run repeats bit for bit (slower); an op
    # without a deterministic kernel stops the run, naming it
    runs_dir: str = "runs"  # where run directories are created
    run_name: str = ""  # "" = <recipe name>-<config hash>
    loggers: str = "csv,tensorboard"  # comma-separated: csv, tensorboard, wandb, mlflow (the last two are extras)
    progress_bar: bool = True  # progress: a bar on a terminal, plain lines every log_every steps otherwise

    def __post_init__(self) -> None:
        check_types(self, "trainer")
        one_of("strategy", self.strategy, ("auto", "ddp", "fsdp"), "trainer")
        unknown = [n for n in self.logger_names if n not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.loggers={self.loggers!r}: {', '.join(unknown)} is not one of: "
                              f"{', '.join(LOGGERS)} (comma-separated)")
        one_of("precision", self.precision, ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"), "trainer")
        for key in ("max_steps", "val_every", "ckpt_every", "log_every", "num_nodes", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 1")
        if self.devices == 0 or self.devices < -1:
            raise ConfigError(f"trainer.devices={self.devices} must be >= 1, or -1 for all")
        if self.max_time_min < 0 or self.limit_val_batches < 0:
            raise ConfigError("trainer.max_time_min and trainer.limit_val_batches must be >= 0")
        if self.val_every_min < 0 or self.ckpt_every_min < 0:
            raise ConfigError(f"trainer.val_every_min={self.val_every_min} and trainer.ckpt_every_min="
                              f"{self.ckpt_every_min} must be >= 0 (0 = the step intervals alone)")
        if self.loss_chunk < 0:
            raise ConfigError(f"trainer.loss_chunk={self.loss_chunk} must be >= 0 (0 = the plain loss)")
        if self.loss_chunk and self.strategy == "fsdp":  # it reads the output weight outside the sharded forward
            raise ConfigError("trainer.loss_chunk is not supported with trainer.strategy=fsdp")
        one_of("fused_loss", self.fused_loss, FUSED_LOSSES, "trainer")
        one_of("checkpoint_writes", self.checkpoint_writes, ("auto", "background", "foreground"), "trainer")
        if self.fused_loss in ("liger", "cce") and self.strategy == "fsdp":  # as loss_chunk: the weight, unsharded
            raise ConfigError(f"trainer.fused_loss={self.fused_loss} is not supported with trainer.strategy=fsdp "
                              "(auto is off there)")
        if self.fused_loss in ("liger", "cce") and self.loss_chunk:
            raise ConfigError(f"trainer.fused_loss={self.fused_loss} and trainer.loss_chunk={self.loss_chunk} both "
                              "choose how the loss avoids the logits: set trainer.loss_chunk 0, or trainer.fused_loss "
                              "auto (the library on CUDA, the chunks elsewhere) or off")


    @property
    def fused_loss_choice(self) -> str:
        """trainer.fused_loss as the LightningModule takes it: auto is off under FSDP (see loss_chunk)."""
        return "off" if self.strategy == "fsdp" else self.fused_loss

    @property
    def logger_names(self) -> list[str]:
        return [n.strip() for n in self.loggers.split(",") if n.strip()]


SECTIONS: dict[str, type[StrictConfig]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "trainer": TrainConfig,
    "decode": DecodeConfig,
}


# The training task of each architecture (the datamodule and LightningModule train.py builds for it)
TASKS = {"encoder_decoder": "translation", "decoder_only": "lm", "encoder_only": "mlm"}

_ABSENT = object()
# Fields added, or whose default changed, after run directories were first named by `config_hash`: while a field
# holds its new default it is hashed as runs made before had it (absent, or the old default), so those runs keep
# their directories (`--ckpt_path last` finds them; a study does not re-run them).
HASHED_AS_BEFORE: dict[tuple[str, str], tuple[Any, Any]] = {
    ("data", "locale_dir"): (list(LOCALE_DIRS), "/usr/share/locale"),
    ("model", "embed_norm"): (False, _ABSENT),
    ("model", "head_dim"): (0, _ABSENT),
    ("model", "v_head_dim"): (0, _ABSENT),
    ("trainer", "val_every_min"): (0.0, _ABSENT),
    ("trainer", "ckpt_every_min"): (0.0, _ABSENT),
    ("trainer", "deterministic"): (False, _ABSENT),
    ("decode", "average_at"): ("last", _ABSENT),
}


@dataclass(frozen=True)
class Experiment:
    name: str
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        if self.model.attention_backend == "flash_attn" and self.trainer.precision == "32-true":
            raise ConfigError("model.attention_backend=flash_attn needs 16-bit activations (the kernel takes fp16 or "
                              "bf16 only): trainer.precision=32-true cannot run it; use trainer.precision bf16-mixed "
                              "(or auto on a GPU), or model.attention_backend sdpa")
        m, d = self.model, self.data
        if m.arch == "encoder_decoder" and m.tie_embeddings == "all" and not d.joint_vocab:
            # the ids of two BPEs would share rows (fairseq: --share-all-embeddings requires a joined dictionary)
            raise ConfigError("model.tie_embeddings=all shares one table between source and target, which needs one "
                              "vocabulary: data.joint_vocab=false trains two; set data.joint_vocab true, or "
                              "model.tie_embeddings decoder (or none)")
        why = unsupported(self.trainer.fused_loss, self.optim.label_smoothing, m.z_loss)
        if why is not None:
            raise ConfigError(f"trainer.fused_loss={self.trainer.fused_loss}: {why}")
        if m.arch == "encoder_decoder" and m.position == "learned" and m.max_seq_len < d.max_len:
            raise ConfigError(f"model.position=learned has model.max_seq_len={m.max_seq_len} positions, fewer than "
                              f"the data.max_len={d.max_len} tokens a training sequence may have: raise "
                              "model.max_seq_len, or lower data.max_len")

    @property
    def task(self) -> str:
        """What fit trains: translation, lm or mlm (TASKS); an arch without one is a ConfigError, raised before
        anything (a tokenizer, a cache) is built."""
        if self.model.arch not in TASKS:
            trains = ", ".join(f"{arch} ({task})" for arch, task in TASKS.items())
            raise ConfigError(f"model.arch={self.model.arch} has no training task; attnlab fit trains {trains}")
        return TASKS[self.model.arch]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{k: getattr(self, k).to_dict() for k in SECTIONS}}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        """Identity of what is trained: everything but where and how it is logged."""
        d = self.to_dict()
        same_loss = ("loss_chunk", "fused_loss")  # how the loss avoids the logits, not which loss
        for k in ("runs_dir", "run_name", "progress_bar", "log_every", *same_loss, "loggers", "checkpoint_writes"):
            d["trainer"].pop(k)
        d["decode"].pop("max_tokens")  # how test and translate batch their decoding
        d["decode"].pop("engine")  # and what decodes
        d["decode"].pop("cuda_graph")  # and how (the same tokens)
        d["data"].pop("min_pairs")  # a check before training, not what is trained
        for (section, key), (now, then) in HASHED_AS_BEFORE.items():
            if d[section][key] == now:
                if then is _ABSENT:
                    d[section].pop(key)
                else:
                    d[section][key] = then
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]

    def run_dir(self) -> Path:
        name = self.trainer.run_name or f"{self.name}-{self.config_hash()}"
        return Path(self.trainer.runs_dir) / name

    def replace(self, **sections: Any) -> Experiment:
        return dataclasses.replace(self, **sections)


def parse_value(text: str, tp: Any = None) -> Any:
    """A command-line value as YAML: 0.1 -> float, true -> bool, rmsnorm -> str, [1, 2] -> list. For a text field
    (`tp` str, or str | None) the text as written: `--data.tgt_lang no` is Norwegian, not False, and
    `--trainer.run_name 001` is '001' (null or ~ still give None where the field takes it)."""
    if tp is str or (set(typing.get_args(tp)) == {str, type(None)} and text not in ("null", "~", "")):
        return text
    try:
        return parse_yaml(text)
    except yaml.YAMLError:
        return text


def known_type(dotted: str) -> Any:
    """The type of config field `dotted`, None for a key that names none (from_raw then says so, with the close
    matches)."""
    try:
        return field_type(dotted, "override")
    except ConfigError:
        return None


def field_type(dotted: str, where: str) -> Any:
    """The type hint of a config field; ConfigError naming `where` when `dotted` names no field."""
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name or "." in name:
        valid = ", ".join(f"{s}.<field>" for s in SECTIONS)
        raise ConfigError(f"{where}: {dotted!r} names no config field; expected one of {valid}")
    hints = typing.get_type_hints(SECTIONS[section])
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        raise ConfigError(f"{where}: {dotted} names no config field{hint}")
    return hints[name]


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS or not key or "." in key:
        valid = ", ".join(f"{s}.<field>" for s in SECTIONS)
        raise ConfigError(f"override --{dotted}: expected one of {valid}")
    raw.setdefault(section, {})[key] = value


def merge(base: dict[str, Any], over: dict[str, Any], source: str) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        if k in SECTIONS:
            if not isinstance(v, dict):
                raise ConfigError(f"{source}: section {k} must be a mapping")
            out.setdefault(k, {}).update(v)
        else:
            out[k] = v
    return out


def load_raw(path: Path, seen: tuple[Path, ...] = (), default_name: bool = True) -> dict[str, Any]:
    """A recipe with its `base:` chain resolved, as plain dicts. Its name: its own `name:`, else its base's, else
    (with `default_name`) the file's stem."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular base: chain {' -> '.join(str(p) for p in seen)}")
    raw = load_yaml(path)
    unknown = [k for k in raw if k not in (*SECTIONS, "base", "name")]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {unknown}; expected base, name, {', '.join(SECTIONS)}")
    for section, cls in SECTIONS.items():  # checked in the file that writes them, not the recipe built on it
        if isinstance(raw.get(section), dict):
            try:
                check_mapping(cls, raw[section], section)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
    base = raw.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base: {base!r} must be the path of the recipe it starts from")
    if base is not None:
        raw = merge(load_raw(path.parent / base, (*seen, path)), raw, str(path))
    if default_name:
        raw.setdefault("name", path.stem)
    return raw


def load_experiment(paths: str | Path | Sequence[str | Path], overrides: dict[str, Any] | None = None) -> Experiment:
    """Load a recipe, or several merged in order (`-c a.yaml -c b.yaml`: b's values override a's, section by
    section, as a `base:` would; the name is the first file's unless a later one sets `name:`), apply dotted
    overrides ({"model.norm": "rmsnorm"}), validate every section."""
    paths = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    if not paths:
        raise ConfigError("no experiment file given (-c FILE)")
    raw: dict[str, Any] = {}
    for i, path in enumerate(paths):
        if not path.exists():
            raise ConfigError(f"experiment file not found: {path}")
        raw = merge(raw, load_raw(path, default_name=i == 0), str(path))
    for dotted, value in (overrides or {}).items():
        apply_override(raw, dotted, value)  # an unknown section is refused there
        section, _, key = dotted.partition(".")
        try:  # an unknown key or a wrong type named as given on the command line, not as the recipe file's
            check_mapping(SECTIONS[section], {key: value}, section)
        except ConfigError as e:
            raise ConfigError(f"override --{dotted}: {e}") from None
    source = " + ".join(str(p) for p in paths)
    if overrides:  # a value out of range, or two fields at odds: the recipe, the overrides or both are at fault
        source += " with " + " ".join(f"--{k} {v}" for k, v in overrides.items())
    return from_raw(raw, source)


def from_raw(raw: dict[str, Any], source: str = "<dict>") -> Experiment:
    if "model" not in raw or "data" not in raw:
        raise ConfigError(f"{source}: an experiment needs model: and data: sections")
    try:
        sections = {k: cls.from_dict(raw.get(k, {})) for k, cls in SECTIONS.items()}
        return Experiment(name=str(raw.get("name", Path(source).stem)), **sections)  # checks across sections
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
