"""Lightning datamodules: tokenizer + token caches built once (rank 0, `prepare_data`), memmaps opened in
`setup`, token-count batches for translation and packed windows for language modelling.

Cache layout under `data_dir`:
  tokenizers/<corpus>-<hash>/   tokenizer.json (or src.json + tgt.json), meta.json, manifest.json
  <corpus>-<hash>/              <split>.<side>.bin/.idx, valid.jsonl, test.jsonl (raw text), manifest.json
The hashes cover the corpus identity (paths, sizes, mtimes) and every setting that changes the content.

The samplers shard batches by rank themselves, so under DDP the Trainer must be built with
`use_distributed_sampler=False` (the dataloaders refuse to run otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from .batching import (
    PairDataset,
    TokenArray,
    TokenArrayWriter,
    TokenBatchSampler,
    WindowBatchSampler,
    WindowDataset,
    atomic_dir,
    cache_is_valid,
    collate_pairs,
    collate_windows,
    read_manifest,
    token_dtype,
    write_manifest,
)
from .config import CACHE_KEYS, TOKENIZER_KEYS, DataConfig, DataError
from .corpora import SPLITS, Corpus, iter_split, open_documents, open_parallel
from .tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID, Tokenizer, check_vocab_size, chunked

log = logging.getLogger("attnlab.data")

FORMAT = 2  # bump when the cache layout or the encoding changes: old caches then no longer match and are rebuilt
# (2: text spelling a special token is encoded as text)
CHUNK = 20_000  # examples per encode_batch call: big enough for the Rust threads, small enough for flat RAM


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", Path(spec).name or spec).strip("_")[:40] or "corpus"


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def _train_texts(corpus: Corpus, cfg: DataConfig, side: str) -> Iterator[str]:
    """Training-split text for BPE: side 'src', 'tgt', 'both' (pairs interleaved) or 'doc'."""
    limit = cfg.tokenizer_max_lines or None
    n = 0
    for split, ex in iter_split(corpus, cfg.valid_fraction, cfg.test_fraction):
        if split != "train":
            continue
        if side == "doc":
            yield ex
        elif side == "both":
            yield ex[0]
            yield ex[1]
        else:
            yield ex[0] if side == "src" else ex[1]
        n += 1
        if limit is not None and n >= limit:
            return


class NotBuiltError(DataError):
    """A tokenizer or token cache is missing and this process (not rank 0) may not build it."""


def _not_built(what: str, where: Path) -> NotBuiltError:
    return NotBuiltError(f"no valid {what} at {where} for these settings, and this process may not build it: "
                         f"under DDP only rank 0 builds it (prepare_data). Is data.data_dir on a filesystem that "
                         f"every rank (every node) sees?")


def env_rank() -> int:
    """The global rank the launcher gave this process (torchrun / Lightning: RANK, LOCAL_RANK; SLURM: SLURM_PROCID;
    read in Lightning's order), before any process group exists; 0 when none is set."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def build_tokenizer(cfg: DataConfig, corpus: Corpus, build: bool = True, mask: bool = False) -> tuple[Tokenizer, str]:
    """Load the tokenizer for (corpus, settings) from the cache, training and caching it when absent
    (when `build`; else a missing tokenizer is a DataError). `mask`: with <mask> (masked language modelling)."""
    check_vocab_size(cfg.vocab_size, mask=mask)
    settings = {"format": FORMAT, "kind": corpus.kind, "corpus": corpus.identity,
                **cfg.settings(TOKENIZER_KEYS)}
    if corpus.kind == "documents":
        settings["joint_vocab"] = True  # one text stream: there is nothing to separate
    if mask:  # only then: every other tokenizer keeps the key (and the cache) it had before <mask> existed
        settings["mask_token"] = True
    key = settings_hash(settings)
    final = Path(cfg.data_dir) / "tokenizers" / f"{_slug(cfg.corpus)}-{key}"
    if not cache_is_valid(final, settings):
        if not build:
            raise _not_built("tokenizer", final)
        t0 = time.perf_counter()
        with atomic_dir(final) as tmp:
            if corpus.kind == "documents":
                tok = Tokenizer.train(_train_texts(corpus, cfg, "doc"), None, cfg.vocab_size, cfg.min_frequency, mask)
            elif cfg.joint_vocab:
                tok = Tokenizer.train(_train_texts(corpus, cfg, "both"), None, cfg.vocab_size, cfg.min_frequency)
            else:
                tok = Tokenizer.train(_train_texts(corpus, cfg, "src"), _train_texts(corpus, cfg, "tgt"),
                                      cfg.vocab_size, cfg.min_frequency)
            tok.save(tmp)
            write_manifest(tmp, settings, vocab_size=tok.vocab_size, src_vocab_size=tok.src_vocab_size)
        log.info("trained BPE tokenizer (vocab %d) in %.1fs -> %s", tok.vocab_size, time.perf_counter() - t0, final)
    return Tokenizer.load(final), key


# ---------------------------------------------------------------------------------------------
# Token caches
# ---------------------------------------------------------------------------------------------
def _cache_target(cfg: DataConfig, corpus: Corpus, tok_key: str, keys: tuple[str, ...], kind: str, build: bool
                  ) -> tuple[dict[str, Any], Path, bool]:
    """(settings, folder, whether a valid cache is already there) of a token cache; NotBuiltError when it is
    missing and this process may not build it."""
    settings = {"format": FORMAT, "kind": corpus.kind, "corpus": corpus.identity, "tokenizer": tok_key,
                **cfg.settings(keys)}
    final = Path(cfg.data_dir) / f"{_slug(cfg.corpus)}{kind}-{settings_hash(settings)}"
    if cache_is_valid(final, settings):
        return settings, final, True
    if not build:
        raise _not_built("token cache", final)
    return settings, final, False


def _check_splits(counts: dict[str, Counter], corpus: Corpus, key: str) -> None:
    for split in SPLITS:
        if counts[split][key] == 0:
            seen = sum(c["read"] for c in counts.values())
            if seen == 0:
                raise DataError(f"corpus {corpus.name}: empty (no examples read)")
            raise DataError(f"corpus {corpus.name}: split {split!r} is empty after filtering ({seen} examples "
                            f"read; per split: { {s: dict(c) for s, c in counts.items()} }). Give more data or "
                            f"raise data.valid_fraction / data.test_fraction")


def build_translation_cache(cfg: DataConfig, corpus: Corpus, tok: Tokenizer, tok_key: str, build: bool = True
                            ) -> Path:
    """Encode every split into memory-mapped arrays. Training pairs that are too long or too unbalanced are
    dropped (Moses clean-corpus-n, on token counts); eval pairs are kept whole (BLEU needs the full test set)
    and only their token ids are cut to max_len. Pairs with an empty side are dropped everywhere."""
    settings, final, ready = _cache_target(cfg, corpus, tok_key, CACHE_KEYS, "", build)
    if ready:
        return final
    t0 = time.perf_counter()
    dtype = token_dtype(max(tok.vocab_size, tok.src_vocab_size))
    counts: dict[str, Counter] = {s: Counter() for s in SPLITS}
    lim = cfg.max_len - 1  # room for the EOS / BOS the collate function adds
    with atomic_dir(final) as tmp:
        writers = {(s, side): TokenArrayWriter(tmp / f"{s}.{side}", dtype) for s in SPLITS for side in ("src", "tgt")}
        texts = {s: open(tmp / f"{s}.jsonl", "w", encoding="utf-8") for s in ("valid", "test")}
        try:
            for chunk in chunked(iter_split(corpus, cfg.valid_fraction, cfg.test_fraction), CHUNK):
                for split in SPLITS:
                    pairs = [ex for s, ex in chunk if s == split]
                    counts[split]["read"] += len(pairs)
                    kept = [p for p in pairs if p[0].strip() and p[1].strip()]
                    counts[split]["empty"] += len(pairs) - len(kept)
                    if not kept:
                        continue
                    src = tok.encode_batch([p[0] for p in kept], side="src")
                    tgt = tok.encode_batch([p[1] for p in kept], side="tgt")
                    if split == "train":
                        keep = []
                        for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
                            if len(s) > lim or len(t) > lim:
                                counts[split]["too_long"] += 1
                            elif cfg.max_ratio and max(len(s), len(t)) > cfg.max_ratio * max(1, min(len(s), len(t))):
                                counts[split]["ratio"] += 1
                            else:
                                keep.append(i)
                        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
                    else:
                        counts[split]["truncated"] += sum(max(len(s), len(t)) > lim
                                                          for s, t in zip(src, tgt, strict=True))
                        src, tgt = [s[:lim] for s in src], [t[:lim] for t in tgt]
                        texts[split].writelines(json.dumps({"src": s, "tgt": t}, ensure_ascii=False) + "\n"
                                                for s, t in kept)
                    writers[split, "src"].append(src)
                    writers[split, "tgt"].append(tgt)
                    counts[split]["kept"] += len(src)
        finally:
            for w in writers.values():
                w.close()
            for f in texts.values():
                f.close()
        _check_splits(counts, corpus, "kept")
        stats = {s: {**dict(counts[s]), "src_tokens": writers[s, "src"].n_tokens,
                     "tgt_tokens": writers[s, "tgt"].n_tokens} for s in SPLITS}
        write_manifest(tmp, settings, dtype=dtype.name, stats=stats, vocab_size=tok.vocab_size,
                       src_vocab_size=tok.src_vocab_size, seconds=round(time.perf_counter() - t0, 2))
    for s in SPLITS:
        c = counts[s]
        log.info("%s: read %d pairs, kept %d (empty %d, too long %d, ratio > %g: %d, eval truncated %d)",
                 s, c["read"], c["kept"], c["empty"], c["too_long"], cfg.max_ratio, c["ratio"], c["truncated"])
    log.info("token cache built in %.1fs -> %s", time.perf_counter() - t0, final)
    return final


def build_lm_cache(cfg: DataConfig, corpus: Corpus, tok: Tokenizer, tok_key: str, build: bool = True) -> Path:
    """Encode documents into one stream per split, each document followed by EOS."""
    settings, final, ready = _cache_target(cfg, corpus, tok_key, TOKENIZER_KEYS, "-lm", build)
    if ready:
        return final
    t0 = time.perf_counter()
    counts: dict[str, Counter] = {s: Counter() for s in SPLITS}
    with atomic_dir(final) as tmp:
        writers = {s: TokenArrayWriter(tmp / f"{s}.doc", token_dtype(tok.vocab_size)) for s in SPLITS}
        try:
            for chunk in chunked(iter_split(corpus, cfg.valid_fraction, cfg.test_fraction), CHUNK):
                for split in SPLITS:
                    raw = [d for s, d in chunk if s == split]
                    docs = [d for d in raw if d.strip()]
                    counts[split]["read"] += len(raw)
                    counts[split]["empty"] += len(raw) - len(docs)
                    if docs:
                        writers[split].append([ids + [EOS_ID] for ids in tok.encode_batch(docs)])
                        counts[split]["kept"] += len(docs)
        finally:
            for w in writers.values():
                w.close()
        _check_splits(counts, corpus, "kept")
        stats = {s: {**dict(counts[s]), "tokens": writers[s].n_tokens} for s in SPLITS}
        write_manifest(tmp, settings, dtype=token_dtype(tok.vocab_size).name, stats=stats,
                       vocab_size=tok.vocab_size, seconds=round(time.perf_counter() - t0, 2))
    log.info("LM token cache built in %.1fs -> %s", time.perf_counter() - t0, final)
    return final


# ---------------------------------------------------------------------------------------------
# Datamodules
# ---------------------------------------------------------------------------------------------
class _DataModule(L.LightningDataModule):
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    mask_token = False  # whether its tokenizer holds <mask> (masked language modelling)
    wait_s = 3 * 3600.0  # how long a non-zero rank waits in prepare_data for rank 0's caches (BPE on WMT is slow)
    poll_s = 2.0

    def __init__(self, cfg: DataConfig | None = None, seed: int = 1, **overrides: Any) -> None:
        super().__init__()
        cfg = cfg or DataConfig()
        self.cfg = cfg.replace(**overrides) if overrides else cfg
        self.seed = seed
        self._tokenizer: Tokenizer | None = None
        self.cache_dir: Path | None = None
        self.manifest: dict[str, Any] = {}
        self._train_sampler: Any = None  # the batch sampler of the last train loader made
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint, for the next one

    # -- building -------------------------------------------------------------------------------
    def _open_corpus(self) -> Corpus:
        raise NotImplementedError

    def _build_cache(self, corpus: Corpus, tok: Tokenizer, key: str, build: bool) -> Path:
        raise NotImplementedError

    def _load(self, build: bool, wait_s: float = 0.0) -> None:
        """Find (or, when `build`, make) the tokenizer and caches. A process that may not build waits up to
        `wait_s` for the builder to publish them, then raises NotBuiltError."""
        check_vocab_size(self.cfg.vocab_size, mask=self.mask_token)
        corpus = self._open_corpus()
        deadline, announced = time.monotonic() + wait_s, False
        while True:
            try:
                tok, key = build_tokenizer(self.cfg, corpus, build, self.mask_token)
                self.cache_dir = self._build_cache(corpus, tok, key, build)
                break
            except NotBuiltError:
                if time.monotonic() >= deadline:
                    raise
                if not announced:
                    log.info("rank %d: waiting up to %.0fs for rank 0 to build the tokenizer and token cache",
                             env_rank(), wait_s)
                    announced = True
                time.sleep(self.poll_s)
        self._tokenizer = tok
        self.manifest = read_manifest(self.cache_dir) or {}

    def is_builder(self) -> bool:
        """Whether this process trains the tokenizer and writes the caches: Lightning's prepare_data process
        (local rank 0, or global rank 0 with prepare_data_per_node=False) once a Trainer is attached, else the
        process whose launcher-given rank is 0 (a plain single process is)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return (trainer.local_rank if self.prepare_data_per_node else trainer.global_rank) == 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return env_rank() == 0

    def prepare_data(self) -> None:
        """Train the tokenizer and build the caches: the only place they are built. Lightning calls it on
        one process (per node) before the others start. Called by hand in every process of a job whose ranks
        start together (srun, torchrun), only rank 0 builds; the others wait for its caches (`wait_s`)."""
        builder = self.is_builder()
        self._load(build=builder, wait_s=0.0 if builder else self.wait_s)

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and open the caches (after prepare_data). A process that is not the builder
        never trains or writes: a cache missing here is a NotBuiltError, not a second build."""
        if self.cache_dir is None or self._tokenizer is None:
            self._load(build=self.is_builder())

    # -- what the model config needs -----------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet: call prepare_data() and setup() first")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def src_vocab_size(self) -> int:
        return self.tokenizer.src_vocab_size

    # -- distribution ---------------------------------------------------------------------------
    def rank_world(self) -> tuple[int, int]:
        """(global rank, world size) from the attached Trainer, else torch.distributed, else (0, 1)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            if trainer.world_size > 1 and getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
                raise DataError("the datamodule shards batches by rank itself: build the Trainer with "
                                "use_distributed_sampler=False")
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _loader(self, dataset: Any, sampler: Any, collate: Any) -> DataLoader:
        """A loader with its own generator: without one, every new iterator (each validation, each epoch) would
        take a draw from the global torch RNG, and dropout after a resume would differ from the run it resumes."""
        w = self.cfg.num_workers
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=w,
                          pin_memory=torch.cuda.is_available(), persistent_workers=w > 0,
                          generator=torch.Generator().manual_seed(self.seed))

    def _split_loader(self, split: str, shuffle: bool) -> DataLoader:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        loader = self._split_loader("train", True)
        self._train_sampler = loader.batch_sampler
        if self._resume_at is not None:
            self._train_sampler.resume(*self._resume_at)
            self._resume_at = None
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._split_loader("valid", False)

    def test_dataloader(self) -> DataLoader:
        return self._split_loader("test", False)

    # -- exact resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """What Lightning keeps in every checkpoint for this datamodule: the epoch being trained and how many of its
        batches the loop has taken (Lightning's own counter). Lightning alone would restart a resumed epoch's data
        from its first batch (its loaders are not resumable); `load_state_dict` makes the next train loader
        continue where the checkpoint left it."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or self._train_sampler is None:
            return {}
        return {"epoch": self._train_sampler.current_epoch,
                "batches": trainer.fit_loop.epoch_loop.batch_progress.current.ready}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state:
            self._resume_at = (int(state["epoch"]), int(state["batches"]))

    def _array(self, name: str) -> TokenArray:
        self.setup()
        assert self.cache_dir is not None
        return TokenArray(self.cache_dir / name, self.manifest["dtype"])


class TranslationDataModule(_DataModule):
    """Parallel corpus -> batches of {src, tgt_in, tgt_out, src_lens, tgt_lens, ntokens, ids}.

    dm = TranslationDataModule(DataConfig(corpus="gettext:de"), seed=1); dm.prepare_data(); dm.setup()
    dm.vocab_size, dm.src_vocab_size, dm.pad_id / bos_id / eos_id, dm.tokenizer, dm.split_texts("test")
    """

    def _open_corpus(self) -> Corpus:
        return open_parallel(self.cfg)

    def _build_cache(self, corpus: Corpus, tok: Tokenizer, key: str, build: bool) -> Path:
        return build_translation_cache(self.cfg, corpus, tok, key, build)

    def dataset(self, split: str) -> PairDataset:
        split = _split_name(split)
        return PairDataset(self._array(f"{split}.src"), self._array(f"{split}.tgt"))

    def sampler(self, split: str, shuffle: bool) -> TokenBatchSampler:
        ds = self.dataset(split)
        rank, world = self.rank_world()
        return TokenBatchSampler(ds.src.lengths() + 1, ds.tgt.lengths() + 1, self.cfg.max_tokens, shuffle=shuffle,
                                 seed=self.seed, rank=rank, world_size=world, sort_by=self.sort_by)

    sort_by = "longer"  # a checkpoint without one (older) counts its data position in target-sorted batches

    def state_dict(self) -> dict[str, Any]:
        return {**state, "sort_by": self.sort_by} if (state := super().state_dict()) else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state:
            self.sort_by = state.get("sort_by", "target")

    def _split_loader(self, split: str, shuffle: bool) -> DataLoader:
        return self._loader(self.dataset(split), self.sampler(split, shuffle), collate_pairs)

    def split_texts(self, split: str) -> tuple[list[str], list[str]]:
        """Raw (sources, references) of the valid or test split, in cache order, for BLEU on real text."""
        split = _split_name(split)
        if split == "train":
            raise DataError("split_texts: raw text is kept for the valid and test splits only")
        self.setup()
        assert self.cache_dir is not None
        srcs, refs = [], []
        with open(self.cache_dir / f"{split}.jsonl", encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                srcs.append(rec["src"])
                refs.append(rec["tgt"])
        return srcs, refs


class LMDataModule(_DataModule):
    """Documents -> packed windows: batches {input (B, seq_len), target (B, seq_len)}, B = max_tokens // seq_len."""

    def _open_corpus(self) -> Corpus:
        return open_documents(self.cfg)

    def _build_cache(self, corpus: Corpus, tok: Tokenizer, key: str, build: bool) -> Path:
        return build_lm_cache(self.cfg, corpus, tok, key, build)

    @property
    def batch_size(self) -> int:
        return max(1, self.cfg.max_tokens // self.cfg.seq_len)

    def dataset(self, split: str) -> WindowDataset:
        split = _split_name(split)
        ds = WindowDataset(self._array(f"{split}.doc"), self.cfg.seq_len)
        if len(ds) == 0:
            raise DataError(f"LM split {split!r} has {len(ds.stream.tokens)} tokens, fewer than data.seq_len + 1 = "
                            f"{self.cfg.seq_len + 1}: lower data.seq_len or give more data")
        return ds

    def _split_loader(self, split: str, shuffle: bool) -> DataLoader:
        ds = self.dataset(split)
        rank, world = self.rank_world()
        sampler = WindowBatchSampler(len(ds), self.batch_size, shuffle=shuffle, seed=self.seed, rank=rank,
                                     world_size=world)
        return self._loader(ds, sampler, collate_windows)


class MLMDataModule(LMDataModule):
    """Masked language modelling: the LM's packed windows ({input, target}; the MLM module masks `input`), and a
    tokenizer with <mask> at id 4 (`mask_id`), trained and cached apart from the LM's."""

    mask_token = True
    mask_id = MASK_ID


def _split_name(split: str) -> str:
    names = {"train": "train", "valid": "valid", "validation": "valid", "val": "valid", "dev": "valid", "test": "test"}
    if split not in names:
        raise DataError(f"unknown split {split!r}: expected train, valid or test")
    return names[split]
