"""Checkpoint files, in one place: atomic save, weights-only load and its errors, migration of older layouts,
averaging, finding a run's last and latest checkpoints, and the tokenizer a checkpoint carries.

A checkpoint is Lightning's dict: state_dict, hyper_parameters (the model / optim / decode config dicts, so
the exact model is rebuilt from the file alone), loops, optimizer state, and `attnlab_format`. Files written
before `attnlab_format` existed (layout 1) are migrated when loaded, by `load_checkpoint` and on resume alike:
- the Block's norms were `norms.<sublayer>` / `out_norms.<sublayer>`; each now has a name of its own
  (`self_attn_norm`, `ffn_out_norm`, `ffn_post_norm`, a parallel post-norm block's `post_norm`, ...);
- the exact-resume position (epoch, batches trained in it) was the state of a `ResumePoint` callback; it is
  now the datamodule's own state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, ModelConfig
from .data.tokenizer import Tokenizer
from .files import write_atomic

log = logging.getLogger("attnlab")
FORMAT = 2  # the layout this code writes (see the module docstring for what changed from 1)
DATAMODULE_KEYS = ("TranslationDataModule", "LMDataModule")  # where Lightning keeps each datamodule's state


# ---------------------------------------------------------------------------------------------- saving
def save_atomic(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then os.replace (files.write_atomic): readers see the
    old file or the new one, never half of one; a kill while saving leaves the previous checkpoint intact, and its
    temporary file (named by its owner) is removed by the next save beside it once that process is gone. A full
    disk raises files.DiskFull naming the folder and the checkpoint's size, the previous checkpoint intact."""
    write_atomic(path, lambda f: torch.save(obj, f), lambda: serialized_size(obj), f"checkpoint {Path(path).name}")


class _Count:
    """A write-only file that only counts the bytes written to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def serialized_size(obj: Any) -> int:
    """The bytes torch.save writes for obj (serialized again into a counter: asked only after a save failed)."""
    counter = _Count()
    torch.save(obj, counter)  # type: ignore[arg-type]
    return counter.n


# ---------------------------------------------------------------------------------------------- loading
def read(path: str | Path) -> dict[str, Any]:
    """Any checkpoint dict (a Lightning checkpoint or a plain state dict) with weights-only unpickling; a missing,
    truncated or foreign file is a ValueError / FileNotFoundError naming it."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; a checkpoint is a file (a run's are its checkpoints/*.ckpt)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, garbage bytes, pickled code objects
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: expected a state dict or a Lightning checkpoint, got {type(ckpt).__name__}")
    return ckpt


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """An attnlab checkpoint (state_dict and the configs that rebuild its model), migrated to this layout."""
    return checked(read(path), path)


def checked(ckpt: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """load_checkpoint's checks and migration, for a checkpoint already in memory (read from or written to path)."""
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"{path}: not an attnlab checkpoint (no state_dict / hyper_parameters)")
    hp = ckpt["hyper_parameters"]
    if not isinstance(hp, dict) or not isinstance(hp.get("model"), dict) or not isinstance(hp.get("optim"), dict):
        keys = sorted(hp)[:10] if isinstance(hp, dict) else type(hp).__name__
        raise ValueError(f"{path}: not an attnlab checkpoint (its hyper_parameters hold no model / optim config: "
                         f"{keys})")
    fmt = ckpt.get("attnlab_format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise ValueError(f"{path}: checkpoint layout {fmt!r} is newer than this attnlab reads ({FORMAT}); "
                         "update attnlab")
    return migrate(ckpt)


def saved_model(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The model config a checkpoint was trained with, as a dict: a field added after it was written holds its
    default there (ModelConfig.from_dict does the same)."""
    return {**ModelConfig().to_dict(), **ckpt.get("hyper_parameters", {}).get("model", {})}


def saved_tokenizer(ckpt: dict[str, Any], where: str | Path) -> dict[str, str] | None:
    """The tokenizer a checkpoint carries, as files written back by this attnlab's code (so two checkpoints of one
    tokenizer compare equal whichever version wrote them), or None for one that carries none (an older attnlab)."""
    files = ckpt.get("tokenizer")
    return Tokenizer.from_files(files, str(where)).to_files() if isinstance(files, dict) else None


def check_compatible(ckpt: dict[str, Any], model_cfg: ModelConfig, path: str | Path) -> None:
    """Refuse a checkpoint trained with a different model config, naming the fields that differ."""
    saved = saved_model(ckpt)
    now = model_cfg.to_dict()
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if diff:
        raise ConfigError(f"{path} was trained with a different model config: " + "; ".join(diff))


def check_same_tokenizer(ckpt: dict[str, Any], tokenizer: Tokenizer, path: str | Path) -> None:
    """Refuse to resume a checkpoint whose tokenizer is not the one the recipe's data builds now: its token ids
    would mean other pieces. Compared as loaded (each side written back by the same code); a checkpoint that
    carries no tokenizer (an older attnlab) is not checked."""
    saved = saved_tokenizer(ckpt, path)
    if saved is not None and saved != saved_tokenizer({"tokenizer": tokenizer.to_files()}, "the recipe's tokenizer"):
        raise ConfigError(f"{path} was trained with another tokenizer than the one this recipe's data builds (a "
                          "data.* setting that shapes it changed: the corpus, its splits, the vocabulary size or "
                          "the lines it learns from); resume with the recipe it was trained with, or start another "
                          "run (another trainer.run_name)")


# ---------------------------------------------------------------------------------------------- migration
_V1_NORM = re.compile(r"^(?P<block>(?:.*\.)?layers\.\d+\.)(?P<kind>norms|out_norms)\.(?P<sub>self_attn|cross_attn|ffn)"
                      r"\.(?P<param>.+)$")


def v1_norm_key(key: str, norm_position: str, block: str) -> str:
    """A layout-1 state-dict key under a Block's `norms` / `out_norms` -> its name now (other keys unchanged)."""
    m = _V1_NORM.match(key)
    if m is None:
        return key
    sub, param = m["sub"], m["param"]
    if m["kind"] == "out_norms":  # sandwich: the norm on the sublayer's output
        name = f"{sub}_out_norm"
    elif norm_position == "post":  # after the residual add: one per sublayer, or the one of a parallel block
        name = "post_norm" if block == "parallel" else f"{sub}_post_norm"
    else:  # pre, sandwich: the norm before the sublayer
        name = f"{sub}_norm"
    return f"{m['block']}{name}.{param}"


def migrate(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Bring a checkpoint dict to this layout in place (and return it). Layout 1: see the module docstring. Any
    layout: weights saved from blocks wrapped by torch.compile (`layers.N._orig_mod.<name>`, before compiled blocks
    kept their names) get their plain names."""
    if any("._orig_mod." in k for k in ckpt.get("state_dict", {})):
        ckpt["state_dict"] = {k.replace("._orig_mod.", "."): v for k, v in ckpt["state_dict"].items()}
    if ckpt.get("attnlab_format", 1) >= FORMAT:
        return ckpt
    model = ckpt.get("hyper_parameters", {}).get("model", {})
    position, block = model.get("norm_position", "post"), model.get("block", "serial")
    ckpt["state_dict"] = {v1_norm_key(k, position, block): v for k, v in ckpt["state_dict"].items()}
    point = (ckpt.get("callbacks") or {}).pop("ResumePoint", None)
    if point is not None:  # read by whichever datamodule resumes (each reads its own class name)
        for key in DATAMODULE_KEYS:
            ckpt.setdefault(key, dict(point))
    ckpt["attnlab_format"] = FORMAT
    return ckpt


# ---------------------------------------------------------------------------------------------- averaging
def average_checkpoints(paths: Sequence[str | Path], out_path: str | Path | None = None) -> dict[str, Any]:
    """Average the weights of checkpoints: Lightning ones ({"state_dict": ..., ...}) or plain state dicts
    (Vaswani et al. 2017 average the last 5 checkpoints of a run).

    Floating tensors are averaged in float64 and cast back to the last checkpoint's dtype; other entries
    (integer buffers, step counters) must be equal in every file. Keys and shapes must match. The result
    keeps the last checkpoint's other entries (epoch, step, hyper_parameters, optimizer state) with the
    averaged weights, is returned, and is written to `out_path` (when given) with `save_atomic`."""
    paths = [str(p) for p in paths]
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    ckpts = [read(p) for p in paths]
    lightning = [isinstance(c.get("state_dict"), dict) for c in ckpts]
    if len(set(lightning)) > 1:
        kinds = ", ".join(f"{p} ({'Lightning' if c else 'state dict'})" for p, c in zip(paths, lightning, strict=True))
        raise ValueError(f"cannot average Lightning checkpoints with plain state dicts: {kinds}")
    if lightning[0]:
        ckpts = [migrate(c) if "hyper_parameters" in c else c for c in ckpts]  # one layout for every file
        same_model(paths, ckpts)
    states = [c["state_dict"] for c in ckpts] if lightning[0] else ckpts
    ref = states[-1]
    for p, s in zip(paths, states, strict=True):
        missing, extra = sorted(set(ref) - set(s)), sorted(set(s) - set(ref))
        if missing or extra:
            raise ValueError(f"{p}: keys differ from {paths[-1]}: missing {missing[:10]}, extra {extra[:10]}")

    n = len(states)
    avg: dict[str, Any] = {}
    shared: dict[tuple, torch.Tensor] = {}  # tied weights (one storage under two keys) stay tied
    for key, last in ref.items():
        values = [s[key] for s in states]
        if not isinstance(last, torch.Tensor) or not last.is_floating_point():
            for p, v in zip(paths, values, strict=True):
                if not _equal(v, last):
                    raise ValueError(f"{key}: non-floating entry differs between {p} and {paths[-1]}; cannot average")
            avg[key] = last
            continue
        for p, v in zip(paths, values, strict=True):
            if not isinstance(v, torch.Tensor) or v.shape != last.shape:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{key}: {p} has {shape}, {paths[-1]} has {tuple(last.shape)}")
        tie = tuple((v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride()) for v in values)
        if last.numel() and tie in shared:
            avg[key] = shared[tie]
            continue
        acc = torch.zeros(last.shape, dtype=torch.float64)
        for v in values:
            acc += v.to(torch.float64)  # a running fp64 sum: exact enough, and one copy of the model in memory
        avg[key] = shared[tie] = (acc / n).to(last.dtype)

    result = dict(ckpts[-1])
    if lightning[0]:
        result["state_dict"] = avg
    else:
        result = avg
    if out_path is not None:
        save_atomic(result, out_path)
    return result


# model fields that act only in training: checkpoints that differ in them average into one model all the same
TRAINING_ONLY = ("dropout", "attn_dropout", "z_loss", "init_std")


def same_model(paths: Sequence[str], ckpts: Sequence[dict[str, Any]]) -> None:
    """Refuse to average checkpoints of different models: a model config field other than TRAINING_ONLY, or the
    tokenizer, differs from the last file's (the one whose config and tokenizer the result keeps)."""
    ref, ref_tokenizer = saved_model(ckpts[-1]), saved_tokenizer(ckpts[-1], paths[-1])
    for p, c in zip(paths[:-1], ckpts[:-1], strict=True):
        here = saved_model(c)
        diff = [f"model.{k}: {here.get(k)!r} vs {ref.get(k)!r}" for k in sorted(set(here) | set(ref))
                if k not in TRAINING_ONLY and here.get(k) != ref.get(k)]
        if diff:
            raise ConfigError(f"cannot average {p} with {paths[-1]}: a different model config: " + "; ".join(diff))
        if saved_tokenizer(c, p) != ref_tokenizer:
            raise ConfigError(f"cannot average {p} with {paths[-1]}: they carry different tokenizers (the same "
                              "token ids mean other pieces)")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


# ---------------------------------------------------------------------------------------------- finding
_STEP = re.compile(r"step=(\d+)")


def last_checkpoints(directory: str | Path, n: int) -> list[Path]:
    """The n most recent *.ckpt in `directory`, oldest first (so the last is the newest): what averaging takes.

    Recency is the training step parsed from Lightning names (`step=500.ckpt`, `epoch=0-step=500.ckpt`,
    ties broken by mtime). Files without `step=` (last.ckpt, a copy of the newest; averaged outputs) are
    ignored when any file has a step, else all are ordered by modification time."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {directory}")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    files = [p for p in directory.glob("*.ckpt") if p.is_file()]
    stepped = [(int(m.group(1)), p.stat().st_mtime, p) for p in files if (m := _STEP.search(p.name))]
    if stepped:
        ordered = [p for _, _, p in sorted(stepped, key=lambda x: (x[0], x[1], x[2].name))]
    else:
        ordered = sorted(files, key=lambda p: (p.stat().st_mtime, p.name))
    return ordered[-n:]


def loads(path: str | Path) -> bool:
    """Whether a checkpoint file can be read (its archive is whole and unpickles weights-only): a file cut short
    by a crash of the machine, or one written by a tool that does not write atomically, is not."""
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return True
    except Exception:
        return False


def resume_candidates(run_dir: str | Path) -> list[Path]:
    """The checkpoints a run can resume from, newest first: checkpoints/last.ckpt, Lightning's hpc_ckpt_N.ckpt
    (saved on SLURM's requeue signal) and the step checkpoints (checkpoints/step=N.ckpt).
    Newest is the highest global step (a step=N file's N, the others' saved step), then the latest modification
    time among equal steps: a run directory copied without its times (cp -r, rsync without -t) has them in any
    order. A file whose step cannot be read comes first, so that `latest_checkpoint` names it as skipped."""
    run_dir = Path(run_dir)
    found = [p for p in [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt"),
                         *(run_dir / "checkpoints").glob("*step=*.ckpt")] if p.is_file()]

    def newest(p: Path) -> tuple[float, int]:
        named = re.fullmatch(r"(?:.*-)?step=(\d+)(?:-v\d+)?\.ckpt", p.name)
        step = int(named.group(1)) if named else checkpoint_step(p)
        return (step if isinstance(step, int) else float("inf")), p.stat().st_mtime_ns

    return sorted(found, key=newest, reverse=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """What a run resumes from: the newest of `resume_candidates` that loads, or None. The files that do not load
    are skipped, with a warning that names them and the one taken instead."""
    skipped = []
    for path in resume_candidates(run_dir):
        if loads(path):
            if skipped:
                log.warning("%s does not load (cut short?); skipped for %s, the newest checkpoint that loads",
                            ", ".join(map(str, skipped)), path)
            return path
        skipped.append(path)
    if skipped:
        log.warning("no checkpoint of %s loads (cut short?): %s", run_dir, ", ".join(map(str, skipped)))
    return None


def checkpoint_step(path: str | Path) -> int | str:
    """The global step a checkpoint was saved at, or 'unknown (...)' for a file that does not load (for logs:
    the fit that loads it says what is wrong)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception as e:
        return f"unknown ({type(e).__name__})"


def run_dir_of(ckpt_path: str | Path) -> Path:
    """runs/<name>/checkpoints/x.ckpt -> runs/<name>; a checkpoint elsewhere -> its own folder."""
    p = Path(ckpt_path).resolve()
    return p.parent.parent if p.parent.name == "checkpoints" else p.parent


def load_tokenizer(ckpt_path: str | Path, ckpt: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the one it carries (so a .ckpt copied anywhere is enough), or,
    for a checkpoint written before checkpoints carried it, the run directory's tokenizer/ folder."""
    ckpt = load_checkpoint(ckpt_path) if ckpt is None else checked(ckpt, ckpt_path)
    if isinstance(ckpt.get("tokenizer"), dict):
        return Tokenizer.from_files(ckpt["tokenizer"], f"{ckpt_path} (its tokenizer)")
    tok_dir = run_dir_of(ckpt_path) / "tokenizer"
    if not tok_dir.exists():
        raise FileNotFoundError(
            f"{ckpt_path} carries no tokenizer (written by an older attnlab) and there is none beside it: expected "
            f"{tok_dir} (fit writes it into the run directory)"
        )
    return Tokenizer.load(tok_dir)
