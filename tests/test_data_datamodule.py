"""Datamodules end to end: caches (reuse, rebuild, interruption), filters, batches, raw text, LM, Lightning."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import datasets
import lightning as L
import pytest
import torch

from attnlab.data import DataConfig, DataError, LMDataModule, TranslationDataModule, batching, tokenizer
from attnlab.data.corpora import hash_unit


def make_dm(corpus: Path | str, tmp_path: Path, **kw) -> TranslationDataModule:
    kw.setdefault("vocab_size", 400)
    kw.setdefault("max_tokens", 600)
    kw.setdefault("valid_fraction", 0.02)
    kw.setdefault("test_fraction", 0.03)
    dm = TranslationDataModule(DataConfig(corpus=str(corpus), data_dir=str(tmp_path / "cache"), **kw), seed=1)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def manifests(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "cache").glob("*/manifest.json")]


def test_translation_end_to_end(data_tsv, tmp_path):
    dm = make_dm(data_tsv, tmp_path)
    assert dm.vocab_size == dm.src_vocab_size == 400 and (dm.pad_id, dm.bos_id, dm.eos_id) == (0, 1, 2)
    loader = dm.train_dataloader()
    n = 0
    for batch in loader:
        B, S = batch["src"].shape
        assert B * S <= 600 and batch["tgt_in"].numel() <= 600 and batch["tgt_in"].shape == batch["tgt_out"].shape
        assert (batch["tgt_in"][:, 0] == dm.bos_id).all()
        assert batch["ntokens"] == int((batch["tgt_out"] != dm.pad_id).sum())
        n += B
    assert n == dm.manifest["stats"]["train"]["kept"] == len(dm.dataset("train"))
    # the valid loader's targets decode to the raw references split_texts returns
    srcs, refs = dm.split_texts("valid")
    assert len(srcs) == len(refs) == len(dm.dataset("valid")) > 0
    for batch in dm.val_dataloader():
        hyps = dm.tokenizer.decode_batch(batch["tgt_out"].tolist())
        srcs_dec = dm.tokenizer.decode_batch(batch["src"].tolist(), side="src")
        for i, h, s in zip(batch["ids"].tolist(), hyps, srcs_dec, strict=True):
            assert h == refs[i] and s == srcs[i]
    assert len(dm.split_texts("test")[0]) == len(dm.dataset("test"))


def test_second_run_uses_the_cache(data_tsv, tmp_path, monkeypatch):
    make_dm(data_tsv, tmp_path)

    def boom(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(tokenizer.Tokenizer, "encode_batch", boom)
    monkeypatch.setattr(tokenizer.Tokenizer, "train", boom)
    dm = make_dm(data_tsv, tmp_path)
    assert len(dm.dataset("train")) > 0 and len(manifests(tmp_path)) == 1


def test_interrupted_build_is_not_trusted(data_tsv, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = batching.TokenArrayWriter.append

    def flaky(self, seqs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of writing the arrays
        return real(self, seqs)

    monkeypatch.setattr(batching.TokenArrayWriter, "append", flaky)
    with pytest.raises(KeyboardInterrupt):
        make_dm(data_tsv, tmp_path)
    caches = [p for p in (tmp_path / "cache").iterdir() if p.name != "tokenizers"]
    assert caches == []  # no cache folder, complete or not
    monkeypatch.setattr(batching.TokenArrayWriter, "append", real)
    dm = make_dm(data_tsv, tmp_path)
    assert dm.manifest["stats"]["train"]["kept"] == len(dm.dataset("train")) > 0


def test_bad_line_found_while_encoding_leaves_no_cache(tmp_path, data_pairs):
    """The tokenizer reads only the first lines (tokenizer_max_lines), so the bad line is met while writing the
    token arrays: the error names file:line and no half-written cache folder is left."""
    p = tmp_path / "c.tsv"
    p.write_bytes("".join(f"{s}\t{t}\n" for s, t in data_pairs[:2000]).encode() + b"caf\xe9\tx\n")
    with pytest.raises(DataError, match=r"c\.tsv:2001: invalid UTF-8"):
        make_dm(p, tmp_path, tokenizer_max_lines=500)
    assert [d.name for d in (tmp_path / "cache").iterdir()] == ["tokenizers"]  # the tokenizer was complete
    assert len(manifests(tmp_path)) == 0 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1


@pytest.mark.parametrize("damage", ["no_manifest", "other_settings", "truncated_file"])
def test_damaged_or_foreign_cache_is_rebuilt(data_tsv, tmp_path, damage):
    dm = make_dm(data_tsv, tmp_path)
    cache = dm.cache_dir
    assert cache is not None
    m = json.loads((cache / "manifest.json").read_text())
    if damage == "no_manifest":
        (cache / "manifest.json").unlink()
    elif damage == "other_settings":  # a folder left by a build with other settings under this name
        m["settings"]["max_len"] = 7
        (cache / "manifest.json").write_text(json.dumps(m))
    else:
        (cache / "train.src.bin").write_bytes(b"\0\0")
    (cache / "stale_marker").write_text("from the old folder")
    again = make_dm(data_tsv, tmp_path)
    assert again.cache_dir == cache and not (cache / "stale_marker").exists()
    assert json.loads((cache / "manifest.json").read_text())["settings"]["max_len"] == 256
    assert len(again.dataset("train")) == m["stats"]["train"]["kept"]


def test_other_settings_get_their_own_cache_and_tokenizer(data_tsv, tmp_path):
    a = make_dm(data_tsv, tmp_path)
    b = make_dm(data_tsv, tmp_path, max_len=20)
    c = make_dm(data_tsv, tmp_path, vocab_size=500)
    assert len({a.cache_dir, b.cache_dir, c.cache_dir}) == 3
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2  # max_len does not retrain BPE
    assert c.vocab_size == 500


def test_filters_are_counted(tmp_path, data_pairs):
    long, unbalanced = ("word " * 300, "Wort " * 300), ("a", "Datei Datei Datei Datei Datei Datei Datei")
    pairs = data_pairs[:1000] + [long] * 3 + [unbalanced] * 2
    p = tmp_path / "c.tsv"
    p.write_text("".join(f"{s}\t{t}\n" for s, t in pairs) + "\tnur Ziel\n", encoding="utf-8")
    dm = make_dm(p, tmp_path, valid_fraction=0.05, test_fraction=0.05, max_len=64, max_ratio=3.0)
    stats = dm.manifest["stats"]
    assert sum(s["read"] for s in stats.values()) == len(pairs) + 1
    assert sum(s["empty"] for s in stats.values()) == 1
    tok = dm.tokenizer
    assert len(tok.encode(unbalanced[1], side="tgt")) > 3 * len(tok.encode(unbalanced[0]))
    # the long and unbalanced pairs are dropped where they land in train, kept (truncated) in valid/test
    for (src, _), n in ((long, 3), (unbalanced, 2)):
        in_train = hash_unit(src) >= 0.1
        if src == long[0]:
            assert stats["train"].get("too_long", 0) == (n if in_train else 0)
            assert sum(stats[s].get("truncated", 0) for s in ("valid", "test")) == (0 if in_train else n)
        else:
            assert stats["train"].get("ratio", 0) == (n if in_train else 0)
    assert dm.dataset("train").src.lengths().max() <= 63
    assert sum(s["kept"] for s in stats.values()) == len(pairs) - (stats["train"].get("too_long", 0)
                                                                    + stats["train"].get("ratio", 0))


def test_empty_corpus_and_empty_split(tmp_path, data_pairs):
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        make_dm(empty, tmp_path)
    few = tmp_path / "few.tsv"
    few.write_text("".join(f"{s}\t{t}\n" for s, t in data_pairs[:5]), encoding="utf-8")
    with pytest.raises(DataError, match=r"split '(valid|test)' is empty"):
        make_dm(few, tmp_path, valid_fraction=0.01, test_fraction=0.01)
    assert manifests(tmp_path) == []


def test_saved_dataset_dict_through_the_datamodule(tmp_path, data_pairs):
    tr = [{"en": s, "de": t} for s, t in data_pairs[:1200]]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"translation": tr[:1000]}),
        "validation": datasets.Dataset.from_dict({"translation": tr[1000:1100]}),
        "test": datasets.Dataset.from_dict({"translation": tr[1100:]}),
    }).save_to_disk(str(tmp_path / "wmt"))
    dm = make_dm(tmp_path / "wmt", tmp_path)
    srcs, refs = dm.split_texts("test")
    assert list(zip(srcs, refs, strict=True)) == data_pairs[1100:1200]
    assert len(dm.dataset("train")) <= 1000


def test_refuses_lightning_distributed_sampler():
    dm = TranslationDataModule(DataConfig())
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1,
                                 _accelerator_connector=SimpleNamespace(use_distributed_sampler=True))
    with pytest.raises(DataError, match="use_distributed_sampler=False"):
        dm.rank_world()
    dm.trainer._accelerator_connector.use_distributed_sampler = False
    assert dm.rank_world() == (1, 2)


def test_lm_datamodule_text_and_gettext_mono(tmp_path, data_pairs, data_write_mo):
    docs = "\n\n".join(f"{s}\n{t}" for s, t in data_pairs[:2000])
    (tmp_path / "lm.txt").write_text(docs, encoding="utf-8")
    cfg = DataConfig(corpus=str(tmp_path / "lm.txt"), data_dir=str(tmp_path / "cache"), vocab_size=400,
                     seq_len=32, max_tokens=256, valid_fraction=0.05, test_fraction=0.05)
    dm = LMDataModule(cfg, seed=1)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == batch["target"].shape == (8, 32)
    assert torch.equal(batch["input"][:, 1:], batch["target"][:, :-1])
    stream = dm.dataset("train").stream
    assert int((torch.from_numpy(stream.tokens.astype("int64")) == dm.eos_id).sum()) == \
        dm.manifest["stats"]["train"]["kept"]  # one EOS after every document
    assert len(list(dm.val_dataloader())) >= 1
    with pytest.raises(DataError, match=r"fewer than data\.seq_len \+ 1"):
        LMDataModule(cfg.replace(seq_len=100_000)).dataset("valid")

    loc = tmp_path / "locale"
    data_write_mo(loc / "de" / "LC_MESSAGES" / "a.mo", [(s, t) for s, t in data_pairs[:1500]])
    mono = LMDataModule(cfg.replace(corpus="gettext-mono:de", locale_dir=str(loc)))
    mono.prepare_data()
    assert mono.manifest["stats"]["train"]["kept"] + mono.manifest["stats"]["valid"]["kept"] + \
        mono.manifest["stats"]["test"]["kept"] == 1500
    assert "Haus" in "".join(mono.tokenizer.decode_batch([mono.dataset("test").stream.tokens[:200].tolist()]))


class _Recorder(L.LightningModule):
    """Counts what Lightning feeds it: batch shapes and the ids seen per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.epochs: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.epochs.setdefault(self.current_epoch, []).extend(batch["ids"].tolist())
        return (self.w * batch["src"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_fit_reshuffles_each_epoch(data_tsv, tmp_path):
    dm = TranslationDataModule(DataConfig(corpus=str(data_tsv), data_dir=str(tmp_path / "cache"), vocab_size=400,
                                          max_tokens=2000), seed=3)
    module = _Recorder()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    e0, e1 = module.epochs[0], module.epochs[1]
    assert sorted(e0) == sorted(e1) == list(range(len(dm.dataset("train"))))
    assert e0 != e1


def _fake_trainer(rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=2, global_rank=rank, local_rank=rank,
                           _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))


def test_only_rank_0_trains_the_tokenizer_and_builds_the_cache(data_tsv, tmp_path, monkeypatch):
    """Under DDP, Lightning runs prepare_data on rank 0, then setup everywhere: rank 1 only loads."""
    cfg = DataConfig(corpus=str(data_tsv), data_dir=str(tmp_path / "cache"), vocab_size=400)
    real_train = tokenizer.Tokenizer.train
    trained_by: list[int] = []

    def train(*a, **k):
        trained_by.append(current_rank["r"])
        return real_train(*a, **k)

    current_rank = {"r": 1}
    monkeypatch.setattr(tokenizer.Tokenizer, "train", train)
    rank1 = TranslationDataModule(cfg, seed=1)
    rank1.trainer = _fake_trainer(1)
    with pytest.raises(DataError, match=r"no valid tokenizer .*only rank 0 builds it"):
        rank1.setup("fit")  # nothing built yet: an error, not a second build
    assert trained_by == [] and not (tmp_path / "cache").exists()
    current_rank["r"] = 0
    rank0 = TranslationDataModule(cfg, seed=1)
    rank0.trainer = _fake_trainer(0)
    rank0.prepare_data()
    rank0.setup("fit")
    current_rank["r"] = 1
    rank1.setup("fit")
    assert trained_by == [0]
    assert rank1.cache_dir == rank0.cache_dir and rank1.vocab_size == rank0.vocab_size
    b0, b1 = next(iter(rank0.train_dataloader())), next(iter(rank1.train_dataloader()))
    assert not set(b0["ids"].tolist()) & set(b1["ids"].tolist())  # each rank its own shard


def test_prepare_data_called_in_every_process_builds_on_rank_0_only(data_tsv, tmp_path, monkeypatch):
    """Ranks started together (srun, torchrun) all call prepare_data: rank 1 (from its environment) waits for
    rank 0's caches instead of training a tokenizer of its own, and gives up with a clear error."""
    import threading

    cfg = DataConfig(corpus=str(data_tsv), data_dir=str(tmp_path / "cache"), vocab_size=400)
    real_train = tokenizer.Tokenizer.train
    trained_on: list[str] = []

    def train(*a, **k):
        trained_on.append(threading.current_thread().name)
        return real_train(*a, **k)

    monkeypatch.setattr(tokenizer.Tokenizer, "train", train)
    monkeypatch.setenv("RANK", "1")
    alone = TranslationDataModule(cfg)
    alone.wait_s, alone.poll_s = 0.3, 0.1
    with pytest.raises(DataError, match="only rank 0 builds it"):
        alone.prepare_data()
    assert trained_on == [] and not (tmp_path / "cache").exists()

    rank0 = TranslationDataModule(cfg)
    rank0.is_builder = lambda: True  # the RANK=0 process
    builder = threading.Thread(target=lambda: (time.sleep(0.3), rank0.prepare_data()), name="rank0")
    rank1 = TranslationDataModule(cfg)
    rank1.wait_s, rank1.poll_s = 120.0, 0.1
    builder.start()
    rank1.prepare_data()  # waits for rank 0, then loads
    builder.join()
    assert trained_on == ["rank0"] and rank1.cache_dir == rank0.cache_dir
    assert rank1.tokenizer.encode("the red house") == rank0.tokenizer.encode("the red house")
