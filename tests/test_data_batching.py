"""Token arrays, atomic folders, token-count and window samplers (epochs, ranks), collate functions."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnlab.data import BOS_ID, EOS_ID, PAD_ID
from attnlab.data.batching import (
    TokenArray,
    TokenArrayWriter,
    TokenBatchSampler,
    WindowBatchSampler,
    WindowDataset,
    atomic_dir,
    cache_is_valid,
    collate_pairs,
    collate_windows,
    write_manifest,
)


def random_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(2, 120, n)
    return src, np.clip(src + rng.integers(-20, 20, n), 2, 150)


def test_token_array_round_trip_and_pickles_without_data(tmp_path):
    seqs = [[5, 6, 7], [], [65535], list(range(4, 1000))]
    w = TokenArrayWriter(tmp_path / "x", np.dtype(np.uint16))
    w.append(seqs[:2])
    w.append(seqs[2:])
    w.close()
    arr = TokenArray(tmp_path / "x", "uint16")
    assert len(arr) == 4 and [a.tolist() for a in (arr[i] for i in range(4))] == seqs
    assert arr.lengths().tolist() == [3, 0, 1, 996]
    assert isinstance(arr.tokens, np.memmap)
    assert len(pickle.dumps(arr)) < 1000  # workers re-map the file instead of receiving the tokens
    assert pickle.loads(pickle.dumps(arr))[3].tolist() == seqs[3]


def test_atomic_dir_leaves_nothing_on_error_and_manifest_checks(tmp_path):
    final = tmp_path / "cache"
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "a.bin").write_bytes(b"1234")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "a.bin").write_bytes(b"1234")
        write_manifest(tmp, {"k": (1, 2)})
    assert cache_is_valid(final, {"k": (1, 2)}) and not cache_is_valid(final, {"k": (1, 3)})
    (final / "a.bin").write_bytes(b"12")  # a truncated file is caught by the recorded sizes
    assert not cache_is_valid(final, {"k": (1, 2)})


BUILD = """
import pathlib, signal, sys, time
from attnlab.data.batching import atomic_dir
# Ctrl-C raises KeyboardInterrupt even where the launcher ignores SIGINT (a background job of a shell without job
# control starts so, and Python then keeps it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
with atomic_dir(pathlib.Path(sys.argv[1])) as tmp:
    (tmp / "tokens.bin").write_bytes(bytes(1000))
    print("building", flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_a_killed_build_leaves_a_folder_the_next_build_removes_but_never_a_running_ones(tmp_path):
    """Two builds in other processes: one SIGKILLed (its `.tmp-*` folder stays behind), one still building. The
    next build beside them removes the killed one's folder only; a folder of another host is left alone too."""
    builds = {name: subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path / name)], stdout=subprocess.PIPE,
                                     text=True) for name in ("killed", "running")}
    try:
        for p in builds.values():
            assert p.stdout.readline() == "building\n"
        builds["killed"].send_signal(signal.SIGKILL)
        builds["killed"].wait()
        left = {p.name.split("@")[0]: p for p in tmp_path.glob(".tmp-*")}
        assert set(left) == {".tmp-killed", ".tmp-running"}
        assert left[".tmp-killed"].name.split("@")[1].endswith(f":{builds['killed'].pid}")  # named by its owner
        elsewhere = tmp_path / ".tmp-other@another-host:1@0123abcd"
        elsewhere.mkdir()
        with atomic_dir(tmp_path / "next") as tmp:
            (tmp / "tokens.bin").write_bytes(b"1")
        assert not left[".tmp-killed"].exists(), "a killed build's folder is removed by the next build"
        assert left[".tmp-running"].is_dir() and elsewhere.is_dir(), "a running build (or another host's) is kept"
        assert (tmp_path / "next" / "tokens.bin").is_file()
        builds["running"].send_signal(signal.SIGINT)  # interrupted, not killed: it removes its own folder
        assert builds["running"].wait(timeout=30) != 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-other@another-host:1@0123abcd", "next"]
    finally:
        for p in builds.values():
            p.kill()
            p.wait()


@pytest.mark.parametrize("max_tokens", [300, 1000, 4096])
def test_token_batches_respect_max_tokens_and_cover_everything(max_tokens):
    src, tgt = random_lengths(2000)
    sampler = TokenBatchSampler(src, tgt, max_tokens, shuffle=True, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for b in batches:
        assert len(b) * src[b].max() <= max_tokens and len(b) * tgt[b].max() <= max_tokens
    assert sorted(i for b in batches for i in b) == list(range(2000))
    # padding is small: lengths within a batch are close
    waste = sum(len(b) * tgt[b].max() - tgt[b].sum() for b in batches) / tgt.sum()
    assert waste < 0.15


def test_token_batches_reshuffle_per_epoch_deterministically():
    src, tgt = random_lengths(1000)
    a = TokenBatchSampler(src, tgt, 1000, seed=1)
    b = TokenBatchSampler(src, tgt, 1000, seed=1)
    e0 = list(a)  # epoch 0, then the sampler advances itself
    assert list(b) == e0
    e1 = list(a)
    b.set_epoch(1)
    assert list(b) == e1 != e0
    a.set_epoch(0)
    assert list(a) == e0
    assert list(TokenBatchSampler(src, tgt, 1000, seed=2)) != e0
    # without shuffling: every epoch the same batches, cut in order from the pairs sorted by (max, src, tgt) length
    fixed = TokenBatchSampler(src, tgt, 1000, shuffle=False)
    first = [list(b) for b in fixed]
    fixed.set_epoch(7)
    assert [list(b) for b in fixed] == first
    flat = [i for b in first for i in b]
    assert flat == sorted(range(len(src)), key=lambda i: (max(src[i], tgt[i]), src[i], tgt[i]))


def test_token_batches_are_cut_by_the_larger_side_and_carry_more_tokens():
    """Sorted by the larger of the two lengths (what bounds B * max(len)), a batch's pairs cost alike; sorted by the
    target alone, a batch of equal targets is cut at its longest source. Pairs whose lengths differ by side (a
    translation's): fewer batches for the same pairs, so more real tokens a batch under the same max_tokens."""
    src, tgt = random_lengths(3000)
    rng = np.random.default_rng(0)
    src = np.maximum(1, (tgt * rng.uniform(0.5, 1.6, len(tgt))).astype(np.int64))  # sources longer or shorter
    new = TokenBatchSampler(src, tgt, 2048, shuffle=False)
    by_target = np.lexsort((src, tgt))  # the order before: (tgt, src)
    cuts = new._cut(src[by_target].tolist(), tgt[by_target].tolist())
    assert len(new) < 0.95 * (len(cuts) - 1)
    batches = list(new)
    assert all(len(b) * max(src[b].max(), tgt[b].max()) <= 2048 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(3000))
    assert tgt.sum() / len(batches) > 1.05 * tgt.sum() / (len(cuts) - 1)
    # the order before, for a run resumed from a checkpoint counted in its batches
    old = TokenBatchSampler(src, tgt, 2048, shuffle=False, sort_by="target")
    assert [i for b in old for i in b] == by_target.tolist() and len(old) == len(cuts) - 1
    with pytest.raises(ValueError, match="sort_by='source'"):
        TokenBatchSampler(src, tgt, 2048, sort_by="source")


def test_oversized_eval_pair_gets_its_own_batch():
    src, tgt = np.array([5, 5, 500, 5]), np.array([5, 5, 5, 5])
    batches = list(TokenBatchSampler(src, tgt, 100, shuffle=False))
    assert [2] in batches and sorted(i for b in batches for i in b) == [0, 1, 2, 3]


SAMPLERS = [
    lambda r, w, shuffle=True: TokenBatchSampler(*random_lengths(997), 1000, shuffle, seed=5, rank=r, world_size=w),
    lambda r, w, shuffle=True: WindowBatchSampler(997, 8, shuffle, seed=5, rank=r, world_size=w),
]


@pytest.mark.parametrize("sampler_for", SAMPLERS)
def test_ranks_get_different_batches_and_the_same_count(sampler_for):
    world = 3
    per_rank = [list(sampler_for(r, world)) for r in range(world)]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1 and counts == {len(sampler_for(0, world))}
    seen = [i for batches in per_rank for b in batches for i in b]
    assert set(seen) == set(range(997))  # everything is seen; only the padding batches repeat
    single = list(sampler_for(0, 1))
    assert len(seen) - 997 <= max(len(b) for b in single) * (world - 1)
    firsts = [tuple(batches[0]) for batches in per_rank]
    assert len(set(firsts)) == world


@pytest.mark.parametrize("sampler_for", SAMPLERS)
def test_eval_shards_count_every_pair_exactly_once(sampler_for):
    """Validation under DDP sums loss and BLEU statistics over ranks: no batch may be repeated there."""
    for world in (2, 3, 4):
        per_rank = [list(sampler_for(r, world, shuffle=False)) for r in range(world)]
        assert [len(b) for b in per_rank] == [len(sampler_for(r, world, shuffle=False)) for r in range(world)]
        seen = sorted(i for batches in per_rank for b in batches for i in b)
        assert seen == list(range(997))


def test_lightning_finds_set_epoch():
    """Lightning calls set_epoch on dataloader.batch_sampler.sampler; the hook forwards it."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from torch.utils.data import DataLoader

    sampler = WindowBatchSampler(50, 4, seed=0)
    loader = DataLoader(list(range(50)), batch_sampler=sampler)
    _set_sampler_epoch(loader, 7)
    assert sampler.epoch == 7


def test_collate_pairs_layout():
    items = [(np.array([10, 11, 12], np.uint16), np.array([20], np.uint16), 4),
             (np.array([13], np.uint16), np.array([21, 22, 23, 24], np.uint16), 9)]
    b = collate_pairs(items)
    assert b["src"].tolist() == [[10, 11, 12, EOS_ID], [13, EOS_ID, PAD_ID, PAD_ID]]
    assert b["tgt_in"].tolist() == [[BOS_ID, 20, PAD_ID, PAD_ID, PAD_ID], [BOS_ID, 21, 22, 23, 24]]
    assert b["tgt_out"].tolist() == [[20, EOS_ID, PAD_ID, PAD_ID, PAD_ID], [21, 22, 23, 24, EOS_ID]]
    assert b["src_lens"].tolist() == [4, 2] and b["tgt_lens"].tolist() == [2, 5]
    assert b["ntokens"] == int((b["tgt_out"] != PAD_ID).sum()) == 7
    assert b["ids"].tolist() == [4, 9] and all(b[k].dtype == torch.long for k in ("src", "tgt_in", "tgt_out"))


def test_collate_pairs_matches_a_row_by_row_layout_and_its_tensor_work_does_not_grow_with_the_batch():
    """Random pairs (empty sides included) against the layout written out row by row; and the collation's torch
    operators are as many for 64 pairs as for 4 (the host work between two GPU steps when num_workers is 0)."""
    from dispatch_count import DispatchCount

    rng = np.random.default_rng(0)
    items = [(rng.integers(4, 60000, rng.integers(0, 9)).astype(np.uint16),
              rng.integers(4, 60000, rng.integers(0, 9)).astype(np.uint16), i) for i in range(64)]
    b = collate_pairs(items)
    S, T = max(len(s) for s, _, _ in items) + 1, max(len(t) for _, t, _ in items) + 1
    for row, (s, t, i) in enumerate(items):
        assert b["src"][row].tolist() == [*s.tolist(), EOS_ID] + [PAD_ID] * (S - len(s) - 1)
        assert b["tgt_in"][row].tolist() == [BOS_ID, *t.tolist()] + [PAD_ID] * (T - len(t) - 1)
        assert b["tgt_out"][row].tolist() == [*t.tolist(), EOS_ID] + [PAD_ID] * (T - len(t) - 1)
        assert (b["src_lens"][row], b["tgt_lens"][row], b["ids"][row]) == (len(s) + 1, len(t) + 1, i)
    assert b["ntokens"] == int((b["tgt_out"] != PAD_ID).sum())
    counts = []
    for n in (4, 64):
        with DispatchCount() as c:
            collate_pairs(items[:n])
        counts.append(sum(c.ops.values()))
    assert counts[0] == counts[1] <= 10, counts


def test_lm_windows_are_shifted_by_one(tmp_path):
    w = TokenArrayWriter(tmp_path / "s", np.dtype(np.uint16))
    w.append([[5, 6, 7, EOS_ID], [8, 9, EOS_ID], [10, 11, 12, 13, EOS_ID]])  # 12 tokens
    w.close()
    ds = WindowDataset(TokenArray(tmp_path / "s", "uint16"), seq_len=4)
    assert len(ds) == 2  # (12 - 1) // 4
    b = collate_windows([ds[0], ds[1]])
    assert b["input"].tolist() == [[5, 6, 7, EOS_ID], [8, 9, EOS_ID, 10]]
    assert b["target"].tolist() == [[6, 7, EOS_ID, 8], [9, EOS_ID, 10, 11]]


def test_collate_says_on_the_host_whether_the_sources_are_padded():
    same = [(np.array([5, 6]), np.array([7]), 0), (np.array([8, 9]), np.array([7, 7]), 1)]
    assert collate_pairs(same)["src_padded"] is False
    assert collate_pairs([*same, (np.array([5]), np.array([7]), 2)])["src_padded"] is True
