"""Token caches on disk, token-count batches for translation, packed windows for language modelling.

A cache is a folder of flat token arrays (`<split>.<side>.bin`, uint16 or int32) with int64 offsets
(`<split>.<side>.idx`, n + 1 entries), memory-mapped when read, so a WMT-size corpus is never held in RAM.
Folders are written under a temporary name and renamed into place; `manifest.json` is written last and holds
the settings it was built with. A folder without a manifest, with other settings, or with a file of the wrong
size is rebuilt, never trusted.

Sequences are stored without special tokens; the collate functions add them:
  translation: src = ids + EOS (fairseq convention), tgt_in = BOS + ids, tgt_out = ids + EOS, padded with PAD
  language modelling: documents are stored each followed by EOS; windows of seq_len + 1 tokens give
  input = window[:-1], target = window[1:]
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..leftovers import remove_orphans, stamped
from .tokenizer import BOS_ID, EOS_ID, PAD_ID

MANIFEST = "manifest.json"


# ---------------------------------------------------------------------------------------------
# Atomic cache folders
# ---------------------------------------------------------------------------------------------
def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x))  # tuples -> lists, so a loaded manifest compares equal to fresh settings


def read_manifest(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def cache_is_valid(d: Path, settings: dict[str, Any]) -> bool:
    """True when `d` holds a complete cache built with exactly `settings`."""
    m = read_manifest(d)
    if m is None or m.get("settings") != _jsonable(settings):
        return False
    try:
        return all((d / name).stat().st_size == size for name, size in m["files"].items())
    except (OSError, KeyError, AttributeError):
        return False


def write_manifest(d: Path, settings: dict[str, Any], **info: Any) -> dict[str, Any]:
    """Record every file's size and the settings; call it last, once everything else is written."""
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"settings": _jsonable(settings), "files": files, **_jsonable(info)}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(d / MANIFEST)
    return manifest


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `final`; on success it replaces `final` in one rename.
    On an exception it is removed, so a failed or interrupted build never leaves a cache behind. A killed build
    leaves its `.tmp-*` folder, named by its owner (host and PID, `leftovers.stamped`): the next build beside it
    removes those whose process is gone, never one still running (nor one of another host, which may be)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(final.parent, ".tmp-*@*@*")
    remove_orphans(final.parent, ".trash-*@*@*")
    tmp = final.parent / stamped(f".tmp-{final.name}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # an invalid cache from an earlier, broken or different run: move it aside, then delete
        trash = final.parent / stamped(f".trash-{final.name}")
        with contextlib.suppress(FileNotFoundError):
            final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:  # another process published the same cache first (same settings): keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Flat token arrays
# ---------------------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


class TokenArrayWriter:
    """Appends sequences to `<stem>.bin`; `close()` writes the offsets to `<stem>.idx`."""

    def __init__(self, stem: Path, dtype: np.dtype) -> None:
        self.stem, self.dtype = stem, dtype
        self.f = open(f"{stem}.bin", "wb")
        self.lengths: list[np.ndarray] = []
        self.n_tokens = 0

    def append(self, seqs: Sequence[Sequence[int]]) -> None:
        if not seqs:
            return
        lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=self.dtype, count=int(lens.sum()))
        self.f.write(flat.tobytes())
        self.lengths.append(lens)
        self.n_tokens += int(lens.sum())

    @property
    def n_seqs(self) -> int:
        return sum(len(x) for x in self.lengths)

    def close(self) -> None:
        self.f.close()
        lens = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        offsets.tofile(f"{self.stem}.idx")


class TokenArray:
    """Read side: memory-mapped tokens and offsets. Opened lazily, so a DataLoader worker (fork or spawn)
    maps the files itself instead of receiving a pickled copy."""

    def __init__(self, stem: Path, dtype: str | np.dtype) -> None:
        self.stem, self.dtype = Path(stem), np.dtype(dtype)
        self._tokens: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    def _open(self) -> None:
        self._offsets = np.memmap(f"{self.stem}.idx", dtype=np.int64, mode="r")
        size = os.path.getsize(f"{self.stem}.bin")
        # np.memmap cannot map an empty file; an empty array reads the same
        self._tokens = (np.memmap(f"{self.stem}.bin", dtype=self.dtype, mode="r") if size
                        else np.zeros(0, self.dtype))

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._open()
        return self._tokens  # type: ignore[return-value]

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._open()
        return self._offsets  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {"stem": self.stem, "dtype": self.dtype, "_tokens": None, "_offsets": None}


# ---------------------------------------------------------------------------------------------
# Batch samplers: sharded by rank, the same number of batches on every rank, reshuffled per epoch
# ---------------------------------------------------------------------------------------------
def shard(batches: list[Any], rank: int, world_size: int, pad: bool = True) -> list[Any]:
    """Rank `rank`'s share, round robin. Training (pad=True): the list is padded by repeating its head to a
    multiple of world_size, so every rank takes the same number of optimizer steps (DDP's gradient all-reduce
    would otherwise wait forever). Evaluation (pad=False): no repeats, so summed metrics count every sentence
    once; ranks may hold one batch fewer, which evaluation tolerates (it syncs once, at the epoch's end)."""
    if world_size == 1 or not batches:
        return batches
    if not pad:
        return batches[rank::world_size]
    total = math.ceil(len(batches) / world_size) * world_size
    padded = batches + [batches[i % len(batches)] for i in range(total - len(batches))]
    return padded[rank::world_size]


class _EpochHook:
    """Lightning calls `set_epoch` on `dataloader.batch_sampler.sampler`, not on the batch sampler itself."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class _ShardedBatchSampler:
    """Common epoch / rank logic. Each `__iter__` draws epoch `self.epoch` and then advances it, so epochs
    reshuffle even when nobody calls `set_epoch`; `set_epoch(e)` (Lightning does, every epoch) pins it.
    Exact resume: `resume(epoch, batches)` makes the next iteration that epoch's order from its batch `batches`
    on (the order is a function of the seed and the epoch, so it continues with exactly the batch the interrupted
    run would have seen); `current_epoch` is the epoch of the iteration in progress."""

    def __init__(self, shuffle: bool, seed: int, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epoch = 0  # the epoch the next iteration draws
        self.current_epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) for the next iteration
        self.sampler = _EpochHook(self)

    def set_epoch(self, epoch: int) -> None:
        if self._resume is None:  # a resumed epoch comes from the checkpoint, whenever the loop calls this
            self.epoch = epoch

    def resume(self, epoch: int, batches: int) -> None:
        """Start the next iteration after `batches` batches of `epoch` (a checkpoint taken at an epoch's end
        resumes at the start of the next one)."""
        if batches >= len(self):
            epoch, batches = epoch + 1, 0
        self._resume = (epoch, batches)

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])  # the same on every rank: they agree on the order

    def batches(self, epoch: int) -> list[np.ndarray]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self._resume is not None:
            (self.epoch, skip), self._resume = self._resume, None
        epoch, self.epoch = self.epoch, self.epoch + 1
        self.current_epoch = epoch
        for b in shard(self.batches(epoch), self.rank, self.world_size, pad=self.shuffle)[skip:]:
            yield b.tolist()

    def __len__(self) -> int:
        if self.shuffle:
            return math.ceil(self.n_batches / self.world_size)
        return len(range(self.rank, self.n_batches, self.world_size))


class TokenBatchSampler(_ShardedBatchSampler):
    """Batches of pair indices with B * max(src_len) <= max_tokens and B * max(tgt_len) <= max_tokens,
    lengths as collated (EOS / BOS included). Pairs are sorted by the larger of their two lengths, the one that
    bounds the batch (then source, then target length), and cut greedily into batches; training shuffles the batch
    order per epoch and, among pairs of equal lengths, which pairs share a batch. Sorted by one side alone (the
    target, as before), a batch of equal targets carries sources of every length and is cut at its longest: on
    gettext:de at max_tokens 8,192 that was 87 batches an epoch of 6,767 target tokens; by the larger side, 76 of
    7,746 (bench/RESULTS.md). A single pair longer than max_tokens (only possible in eval splits) gets a batch of
    its own. `sort_by="target"` keeps the order before (target, then source length), for a run resumed from a
    checkpoint made with it."""

    def __init__(self, src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, sort_by: str = "longer") -> None:
        super().__init__(shuffle, seed, rank, world_size)
        self.src_lens, self.tgt_lens = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
        if len(self.src_lens) != len(self.tgt_lens) or len(self.src_lens) == 0:
            raise ValueError("src_lens and tgt_lens must have the same, non-zero length")
        self.max_tokens = max_tokens
        if sort_by not in ("longer", "target"):
            raise ValueError(f"sort_by={sort_by!r}: longer or target")
        cost = np.maximum(self.src_lens, self.tgt_lens)  # (N,) what a pair adds to B * max(len) of a side
        # lexsort keys, the last one first
        self.keys = (self.tgt_lens, self.src_lens, cost) if sort_by == "longer" else (self.src_lens, self.tgt_lens)
        self.order = np.lexsort(self.keys)
        # The cut points depend only on the sorted length sequence, which tie-breaking never changes: compute
        # them once; each epoch then only re-draws the order within equal lengths (and the batch order).
        self.starts = self._cut(self.src_lens[self.order].tolist(), self.tgt_lens[self.order].tolist())
        self.n_batches = len(self.starts) - 1

    def _cut(self, src: list[int], tgt: list[int]) -> np.ndarray:
        starts, n, ms, mt = [0], 0, 0, 0
        for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
            s2, t2 = max(ms, s), max(mt, t)
            if n and (n + 1) * max(s2, t2) > self.max_tokens:  # adding pair i would overflow a side
                starts.append(i)
                n, s2, t2 = 0, s, t
            n, ms, mt = n + 1, s2, t2
        starts.append(len(src))
        return np.asarray(starts)

    def batches(self, epoch: int) -> list[np.ndarray]:
        if not self.shuffle:
            return np.split(self.order, self.starts[1:-1])
        rng = self._rng(epoch)
        order = np.lexsort((rng.random(len(self.src_lens)), *self.keys))
        batches = np.split(order, self.starts[1:-1])
        return [batches[i] for i in rng.permutation(len(batches))]


class WindowBatchSampler(_ShardedBatchSampler):
    """Fixed-size batches of LM window indices; training shuffles the windows per epoch."""

    def __init__(self, n_windows: int, batch_size: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(shuffle, seed, rank, world_size)
        if n_windows < 1 or batch_size < 1:
            raise ValueError(f"n_windows={n_windows} and batch_size={batch_size} must be >= 1")
        self.n_windows, self.batch_size = n_windows, batch_size
        self.n_batches = math.ceil(n_windows / batch_size)

    def batches(self, epoch: int) -> list[np.ndarray]:
        idx = self._rng(epoch).permutation(self.n_windows) if self.shuffle else np.arange(self.n_windows)
        return [idx[i:i + self.batch_size] for i in range(0, self.n_windows, self.batch_size)]


# ---------------------------------------------------------------------------------------------
# Datasets and collate functions
# ---------------------------------------------------------------------------------------------
class PairDataset(Dataset):
    """Item i: (source ids, target ids, i) as numpy views of the memory-mapped caches."""

    def __init__(self, src: TokenArray, tgt: TokenArray) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"{src.stem} has {len(src)} sequences, {tgt.stem} has {len(tgt)}")
        self.src, self.tgt = src, tgt

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        return self.src[i], self.tgt[i], i


def _scatter_rows(seqs: list[np.ndarray], width: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, width) int64 PAD, row i holding seqs[i] from column `offset`; and the lengths (B,). A handful of numpy
    operations whatever B is: a loop over the rows cost ~7 tensor operations each, ~2k a batch of the demo (2 ms on
    a CPU core for 40 pairs), run on the host between two GPU steps when data.num_workers is 0."""
    lens = np.fromiter((len(x) for x in seqs), np.int64, len(seqs))  # (B,)
    out = np.full((len(seqs), width), PAD_ID, np.int64)  # (B, width)
    if lens.sum():
        rows = np.repeat(np.arange(len(seqs)), lens)  # (N,) the row of every token
        cols = np.arange(rows.size) - np.repeat(np.cumsum(lens) - lens, lens)  # (N,) its place in that row
        out[rows, cols + offset] = np.concatenate(seqs)
    return out, lens


def collate_pairs(items: list[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, Any]:
    """src (B, S) = ids + EOS; tgt_in (B, T) = BOS + ids; tgt_out (B, T) = ids + EOS; PAD elsewhere.
    Also src_lens (B,), tgt_lens (B,), ntokens (non-pad target tokens, int), ids (B,) dataset indices and
    src_padded (bool: any source shorter than S)."""
    B, rows = len(items), np.arange(len(items))
    S = max(len(s) for s, _, _ in items) + 1
    T = max(len(t) for _, t, _ in items) + 1
    src, s_n = _scatter_rows([s for s, _, _ in items], S, 0)  # (B, S), (B,)
    src[rows, s_n] = EOS_ID
    tgt_in, t_n = _scatter_rows([t for _, t, _ in items], T, 1)  # (B, T), (B,)
    tgt_in[:, 0] = BOS_ID
    tgt_out = np.empty_like(tgt_in)  # (B, T): tgt_in shifted left by one
    tgt_out[:, :-1] = tgt_in[:, 1:]
    tgt_out[:, -1] = PAD_ID
    tgt_out[rows, t_n] = EOS_ID
    return {"src": torch.from_numpy(src), "tgt_in": torch.from_numpy(tgt_in), "tgt_out": torch.from_numpy(tgt_out),
            "src_lens": torch.from_numpy(s_n + 1), "tgt_lens": torch.from_numpy(t_n + 1),
            "ntokens": int(t_n.sum()) + B, "ids": torch.tensor([i for _, _, i in items]),
            "src_padded": bool(s_n.min() < s_n.max())}  # Python values: the model reads no tensor for them


class WindowDataset(Dataset):
    """Window i: tokens [i * L, i * L + L + 1) of the split's stream (documents joined, each ending in EOS)."""

    def __init__(self, stream: TokenArray, seq_len: int) -> None:
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.stream.tokens) - 1) // self.seq_len)  # the last target token needs a successor

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.stream.tokens[start:start + self.seq_len + 1]


def collate_windows(items: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """input (B, L) and target (B, L): the same windows shifted by one token."""
    x = torch.from_numpy(np.stack(items).astype(np.int64))  # (B, L + 1)
    return {"input": x[:, :-1].contiguous(), "target": x[:, 1:].contiguous()}
