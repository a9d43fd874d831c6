"""Text sources: parallel pairs for translation, documents for language modelling.

`open_parallel(cfg)` / `open_documents(cfg)` turn `DataConfig.corpus` into a `Corpus`: one stream factory per
split it ships with, and an identity (paths, sizes, mtimes) that keys the caches. `iter_split` routes examples
to train/valid/test; a split the corpus lacks is carved out of train by a hash of the source text, so the same
source string never lands in two splits and the split does not depend on order or seed.

Text is passed on as read: only the line terminator is removed. gettext accelerator markers (`_File`, `&Open`)
are kept on both sides: stripping them is lossy (`file_name`, `Tom & Jerry`) and the model can learn them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .config import DataConfig, DataError
from .gettext import gettext_corpus_pairs
from .readers import (
    need_file,
    pair_from_record,
    read_aligned,
    read_jsonl_docs,
    read_jsonl_pairs,
    read_text_docs,
    read_tsv,
)

log = logging.getLogger("attnlab.data")

SPLITS = ("train", "valid", "test")
SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "validation", "dev"), "test": ("test",)}


@dataclass
class Corpus:
    """A source of examples: (src, tgt) pairs (parallel) or strings (documents)."""

    name: str
    kind: str  # "parallel" | "documents"
    streams: dict[str, Callable[[], Iterator[Any]]]  # split -> fresh iterator; "train" always present
    identity: list[Any] = field(default_factory=list)  # what the cache key hashes besides the settings


# ---------------------------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------------------------
def hash_unit(text: str) -> float:
    """A stable pseudo-random number in [0, 1) from a string (blake2b, so independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") / 2.0**64


def iter_split(corpus: Corpus, valid_fraction: float, test_fraction: float) -> Iterator[tuple[str, Any]]:
    """Yield (split, example) over the whole corpus. Missing valid/test splits come out of train by hash."""
    carve: list[tuple[str, float]] = []
    lo = 0.0
    for split, frac in (("valid", valid_fraction), ("test", test_fraction)):
        if split not in corpus.streams:
            carve.append((split, lo + frac))  # hash in [lo, lo + frac) -> split
            lo += frac
    for split in SPLITS:
        if split not in corpus.streams:
            continue
        for ex in corpus.streams[split]():
            if split == "train" and carve:
                u = hash_unit(ex[0] if corpus.kind == "parallel" else ex)
                split_of = next((s for s, hi in carve if u < hi), "train")
                yield split_of, ex
            else:
                yield split, ex


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets: hub names (network or HF cache) and save_to_disk folders
# ---------------------------------------------------------------------------------------------
def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json"))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connect to the hub, so that offline a name fails in seconds, not after datasets' retries."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
           for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline_hub() -> Iterator[None]:
    """datasets reads HF_HUB_OFFLINE at import; flip its module flags for one call (cache-only lookup)."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def load_hf(spec: str) -> dict[str, Any]:
    """split -> datasets.Dataset, from a save_to_disk folder or a hub `name[:config]`."""
    import datasets

    path = Path(spec)
    if path.exists():
        if not is_saved_dataset(path):
            raise DataError(f"{path}: not a dataset saved with save_to_disk (no dataset_dict.json or state.json)")
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # a damaged folder: arrow files missing or unreadable
            raise DataError(f"{path}: cannot load the saved dataset: {type(e).__name__}: {e}") from None
    else:
        name, _, config = spec.partition(":")
        online = _hub_reachable()
        try:
            with contextlib.nullcontext() if online else _offline_hub():
                ds = datasets.load_dataset(name, config or None)
        except Exception as e:
            where = "" if online else " (the hub is unreachable and it is not in the Hugging Face cache)"
            what = f"{name!r}" + (f" config {config!r}" if config else "")
            raise DataError(
                f"corpus hf:{spec}: cannot load Hugging Face dataset {what}"
                f"{where}: {type(e).__name__}: {str(e)[:200]}. Offline, pass local files instead: a folder written "
                f"by datasets' save_to_disk, a .tsv/.jsonl file, or line-aligned <prefix>.<src>/<prefix>.<tgt> files"
            ) from None
    if isinstance(ds, datasets.Dataset):
        return {"train": ds}
    out: dict[str, Any] = {}
    for split, aliases in SPLIT_ALIASES.items():
        for a in aliases:
            if a in ds:
                out[split] = ds[a]
                break
    if "train" not in out:
        raise DataError(f"corpus {spec}: no train split (splits: {sorted(ds)})")
    return out


def _iter_hf_pairs(ds: Any, where: str, src_lang: str, tgt_lang: str) -> Iterator[tuple[str, str]]:
    row = 0
    for batch in ds.iter(batch_size=1000):  # column batches: much faster than row dicts
        keys = list(batch)
        for i in range(len(batch[keys[0]]) if keys else 0):
            yield pair_from_record({k: batch[k][i] for k in ("translation", "src", "tgt") if k in batch},
                                    src_lang, tgt_lang, f"{where} row {row}")
            row += 1


def _iter_hf_docs(ds: Any, where: str, key: str) -> Iterator[str]:
    if key not in ds.column_names:
        raise DataError(f"{where}: no column {key!r} (columns: {ds.column_names}); set data.text_field")
    row = 0
    for batch in ds.iter(batch_size=1000):
        for text in batch[key]:
            if not isinstance(text, str):
                raise DataError(f"{where} row {row}: {key!r} is {type(text).__name__}, not a string")
            yield text
            row += 1


# ---------------------------------------------------------------------------------------------
# Spec -> Corpus
# ---------------------------------------------------------------------------------------------
def file_identity(paths: list[Path]) -> list[Any]:
    """Absolute paths with size and mtime: an edited file gets a new cache."""
    out = []
    for p in paths:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _dir_identity(path: Path) -> list[Any]:
    return file_identity(sorted(p for p in path.rglob("*") if p.is_file()))


def _split_files(d: Path, cfg: DataConfig, parallel: bool) -> dict[str, Callable[[], Iterator[Any]]]:
    """A folder with per-split files: <split>.tsv, <split>.jsonl, <split>.<src>+<split>.<tgt> (parallel) or
    <split>.txt / <split>.jsonl (documents); split names train, valid|validation|dev, test."""
    streams: dict[str, Callable[[], Iterator[Any]]] = {}
    for split, aliases in SPLIT_ALIASES.items():
        for a in aliases:
            opener = _file_opener(d / a, cfg, parallel)
            if opener is not None:
                streams[split] = opener[0]
                break
    if "train" not in streams:
        kinds = f"train.tsv, train.jsonl or train.{cfg.src_lang} + train.{cfg.tgt_lang}" if parallel \
            else "train.txt or train.jsonl"
        raise DataError(f"corpus folder {d}: no training data ({kinds})")
    return streams


def _reader(p: Path, cfg: DataConfig, parallel: bool) -> Callable[[], Iterator[Any]] | None:
    """The reader of one corpus file by its suffix; None for a kind this task does not read."""
    if parallel and p.suffix == ".tsv":
        return lambda: read_tsv(p)
    if parallel and p.suffix in (".jsonl", ".json"):
        return lambda: read_jsonl_pairs(p, cfg.src_lang, cfg.tgt_lang)
    if not parallel and p.suffix in (".jsonl", ".json"):
        return lambda: read_jsonl_docs(p, cfg.text_field)
    if not parallel and p.suffix == ".txt":
        return lambda: read_text_docs(p)
    return None


Opener = tuple[Callable[[], Iterator[Any]], list[Path]]  # a reader and the files it reads (the cache identity)


def _file_opener(stem: Path, cfg: DataConfig, parallel: bool) -> Opener | None:
    """The reader for `stem`: the file itself (by suffix), else the one of <stem>.tsv / .jsonl / .json / .txt or
    the <stem>.<src_lang> + <stem>.<tgt_lang> pair that exists; None when none does. Two of them existing is an
    error naming both: which one was meant is not ours to guess."""
    if stem.is_file():
        reader = _reader(stem, cfg, parallel)
        return (reader, [stem]) if reader is not None else None
    found: list[Opener] = []
    for p in (stem.with_name(stem.name + s) for s in (".tsv", ".jsonl", ".json", ".txt")):
        if p.is_file() and (reader := _reader(p, cfg, parallel)) is not None:
            found.append((reader, [p]))
    a, b = stem.with_name(f"{stem.name}.{cfg.src_lang}"), stem.with_name(f"{stem.name}.{cfg.tgt_lang}")
    if parallel and a.is_file() and b.is_file():
        found.append((lambda: read_aligned(a, b), [a, b]))
    elif parallel and (a.is_file() or b.is_file()) and not found:
        need_file(a), need_file(b)  # one side without the other: an error naming the missing one
    if len(found) > 1:
        names = "; ".join(" + ".join(map(str, files)) for _, files in found)
        raise DataError(f"data.corpus={str(stem)!r} is ambiguous: {names} all match it. Name one file "
                        f"(e.g. data.corpus={found[0][1][0]}) or remove the others")
    return found[0] if found else None


def open_parallel(cfg: DataConfig) -> Corpus:
    """The (source, target) corpus that `cfg.corpus` names."""
    spec = cfg.corpus
    if spec.startswith("gettext:"):
        lang = spec.split(":", 1)[1]
        if lang != cfg.tgt_lang or cfg.src_lang != "en":
            raise DataError(f"data.corpus={spec!r} pairs English with {lang!r}: set data.src_lang='en' and "
                            f"data.tgt_lang={lang!r} (got {cfg.src_lang!r} -> {cfg.tgt_lang!r})")
        pairs, files = gettext_corpus_pairs(cfg, lang)
        return Corpus(spec, "parallel", {"train": lambda: iter(pairs)}, ["gettext", file_identity(files)])
    if spec.startswith("hf:") or is_saved_dataset(Path(spec)):
        name = spec[3:] if spec.startswith("hf:") else spec
        dsets = load_hf(name)
        streams = {s: (lambda ds=ds, s=s: _iter_hf_pairs(ds, f"{spec} [{s}]", cfg.src_lang, cfg.tgt_lang))
                   for s, ds in dsets.items()}
        ident = _dir_identity(Path(name)) if Path(name).exists() else ["hf", name, _hf_fingerprints(dsets)]
        return Corpus(spec, "parallel", streams, ident)
    path = Path(spec)
    if path.is_dir():
        streams = _split_files(path, cfg, parallel=True)
        return Corpus(spec, "parallel", streams, _dir_identity(path))
    opener = _file_opener(path, cfg, parallel=True)
    if opener is None:
        if path.is_file():
            raise DataError(f"corpus file {path}: unknown kind; translation reads .tsv, .jsonl, or line-aligned "
                            f"<prefix>.{cfg.src_lang} / <prefix>.{cfg.tgt_lang} files")
        raise DataError(f"corpus not found: {path} (no such file or folder, nor {path}.{cfg.src_lang} / "
                        f"{path}.{cfg.tgt_lang})")
    reader, files = opener
    return Corpus(spec, "parallel", {"train": reader}, file_identity(files))


def open_documents(cfg: DataConfig) -> Corpus:
    """The monolingual corpus that `cfg.corpus` names. `gettext:<lang>` (a parallel spec) reads as
    `gettext-mono:<lang>`: the <lang> side, one string per document."""
    spec = cfg.corpus
    if spec.startswith(("gettext-mono:", "gettext:")):
        parts = spec.split(":")
        lang, side = parts[1], (parts[2] if len(parts) > 2 else parts[1])
        if len(parts) > 3 or side not in (lang, "en"):
            raise DataError(f"data.corpus={spec!r}: expected gettext-mono:<lang> or gettext-mono:<lang>:en")
        pairs, files = gettext_corpus_pairs(cfg, lang)

        def docs() -> Iterator[str]:
            seen: set[str] = set()
            for src, tgt in pairs:
                text = src if side == "en" else tgt
                if text not in seen:
                    seen.add(text)
                    yield text

        return Corpus(spec, "documents", {"train": docs}, ["gettext-mono", side, file_identity(files)])
    if spec.startswith("hf:") or is_saved_dataset(Path(spec)):
        name = spec[3:] if spec.startswith("hf:") else spec
        dsets = load_hf(name)
        streams = {s: (lambda ds=ds, s=s: _iter_hf_docs(ds, f"{spec} [{s}]", cfg.text_field))
                   for s, ds in dsets.items()}
        ident = _dir_identity(Path(name)) if Path(name).exists() else ["hf", name, _hf_fingerprints(dsets)]
        return Corpus(spec, "documents", streams, ident)
    path = Path(spec)
    if path.is_dir():
        return Corpus(spec, "documents", _split_files(path, cfg, parallel=False), _dir_identity(path))
    opener = _file_opener(path, cfg, parallel=False)
    if opener is None:
        if path.is_file():
            raise DataError(f"corpus file {path}: unknown kind; language modelling reads .txt or .jsonl")
        raise DataError(f"corpus not found: {path}")
    reader, files = opener
    return Corpus(spec, "documents", {"train": reader}, file_identity(files))


def _hf_fingerprints(dsets: dict[str, Any]) -> dict[str, str]:
    return {s: getattr(ds, "_fingerprint", "") for s, ds in dsets.items()}
