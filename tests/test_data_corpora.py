"""Corpus readers: every format, its errors (file:line), Hugging Face datasets, gettext catalogs, splits."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

import datasets
import pytest

from attnlab.config import ConfigError
from attnlab.data import DataConfig, DataError, open_documents, open_parallel
from attnlab.data.corpora import SPLITS, hash_unit, iter_split
from attnlab.data.gettext import gettext_pairs, read_mo


def pairs_of(cfg: DataConfig) -> dict[str, list]:
    out: dict[str, list] = {s: [] for s in SPLITS}
    for split, ex in iter_split(open_parallel(cfg), cfg.valid_fraction, cfg.test_fraction):
        out[split].append(ex)
    return out


def docs_of(cfg: DataConfig) -> dict[str, list]:
    out: dict[str, list] = {s: [] for s in SPLITS}
    for split, ex in iter_split(open_documents(cfg), cfg.valid_fraction, cfg.test_fraction):
        out[split].append(ex)
    return out


def all_pairs(cfg: DataConfig) -> list:
    return [p for ps in pairs_of(cfg).values() for p in ps]


# ---- DataConfig -----------------------------------------------------------------------------------------
def test_config_roundtrip_and_strict_keys():
    cfg = DataConfig(corpus="x.tsv", vocab_size=1000, max_ratio=2)
    assert DataConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(cfg.max_ratio, float)
    with pytest.raises(ConfigError, match=r"data\.vocab_sise.*did you mean data\.vocab_size"):
        DataConfig.from_dict({"vocab_sise": 10})
    with pytest.raises(ConfigError, match=r"data\.joint_vocab='yes' has type str"):
        DataConfig.from_dict({"joint_vocab": "yes"})


@pytest.mark.parametrize("kw, match", [
    ({"vocab_size": 0}, r"data\.vocab_size=0"),
    ({"valid_fraction": 1.5}, r"data\.valid_fraction=1\.5"),
    ({"valid_fraction": 0.5, "test_fraction": 0.5}, r"valid_fraction \+ data\.test_fraction"),
    ({"max_ratio": 0.5}, r"data\.max_ratio=0\.5"),
    ({"src_lang": "de"}, r"src_lang and data\.tgt_lang are both 'de'"),
    ({"max_tokens": 10, "max_len": 20}, r"data\.max_tokens=10 < data\.max_len=20"),
    ({"corpus": " "}, r"data\.corpus"),
])
def test_config_validation_names_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        DataConfig(**kw)


# ---- file formats ---------------------------------------------------------------------------------------
def test_aligned_tsv_jsonl_give_the_same_pairs(tmp_path, data_pairs):
    pairs = data_pairs[:50]
    (tmp_path / "c.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    # CRLF is fine, and so is a byte order mark (utf-8-sig: as Windows editors save), which is not text
    (tmp_path / "c.de").write_text("".join(t + "\r\n" for _, t in pairs), encoding="utf-8-sig")
    (tmp_path / "t.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs) + "\n", encoding="utf-8-sig")
    (tmp_path / "wmt.jsonl").write_text("".join(json.dumps({"translation": {"de": t, "en": s}}) + "\n"
                                                for s, t in pairs), encoding="utf-8-sig")
    (tmp_path / "st.jsonl").write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in pairs),
                                       encoding="utf-8")
    for spec in ("c", "t.tsv", "t", "wmt.jsonl", "wmt", "st.jsonl"):
        got = all_pairs(DataConfig(corpus=str(tmp_path / spec)))
        assert sorted(got) == sorted(pairs), spec


def test_a_stem_that_names_two_corpora_is_an_error_naming_both(tmp_path, data_pairs):
    """c/bad.en + c/bad.de beside c/bad.jsonl: which one `data.corpus=c/bad` means is not guessed."""
    pairs = data_pairs[:5]
    (tmp_path / "bad.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (tmp_path / "bad.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in pairs),
                                        encoding="utf-8")
    with pytest.raises(DataError, match="ambiguous") as e:
        open_parallel(DataConfig(corpus=str(tmp_path / "bad")))
    for name in ("bad.jsonl", "bad.en", "bad.de"):
        assert str(tmp_path / name) in str(e.value)
    assert sorted(all_pairs(DataConfig(corpus=str(tmp_path / "bad.jsonl")))) == sorted(pairs)  # one named: fine
    (tmp_path / "docs.txt").write_text("a\n\nb\n", encoding="utf-8")
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"ambiguous: .*docs\.jsonl; .*docs\.txt"):
        open_documents(DataConfig(corpus=str(tmp_path / "docs")))


def test_a_stem_resolved_to_a_file_tracks_that_file(tmp_path, data_pairs):
    """The cache identity of data.corpus=c (read from c.tsv) changes when c.tsv changes."""
    (tmp_path / "c.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in data_pairs[:5]), encoding="utf-8")
    before = open_parallel(DataConfig(corpus=str(tmp_path / "c"))).identity
    (tmp_path / "c.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in data_pairs[:6]), encoding="utf-8")
    assert open_parallel(DataConfig(corpus=str(tmp_path / "c"))).identity != before


def test_split_folder_uses_its_splits(tmp_path, data_pairs):
    for split, chunk in (("train", data_pairs[:100]), ("valid", data_pairs[100:110]), ("test", data_pairs[110:125])):
        (tmp_path / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in chunk), encoding="utf-8")
    got = pairs_of(DataConfig(corpus=str(tmp_path)))
    assert got["train"] == data_pairs[:100] and got["valid"] == data_pairs[100:110]
    assert got["test"] == data_pairs[110:125]


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"corpus not found: .*nope"):
        open_parallel(DataConfig(corpus=str(tmp_path / "nope")))
    (tmp_path / "c.en").write_text("a\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"corpus file not found: .*c\.de"):
        open_parallel(DataConfig(corpus=str(tmp_path / "c")))


def test_line_count_mismatch_names_both_counts(tmp_path):
    (tmp_path / "c.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "c.de").write_text("x\ny", encoding="utf-8")  # no final newline: still 2 lines
    with pytest.raises(DataError, match=r"c\.en has 3 lines, .*c\.de has 2"):
        all_pairs(DataConfig(corpus=str(tmp_path / "c")))


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "c.tsv").write_bytes(b"a\tb\nok\tgut\nbad \xff\xfe\tx\n")
    with pytest.raises(DataError, match=r"c\.tsv:3: invalid UTF-8"):
        all_pairs(DataConfig(corpus=str(tmp_path / "c.tsv")))


def test_tsv_line_without_tab(tmp_path):
    (tmp_path / "c.tsv").write_text("a\tb\nno tab here\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.tsv:2: expected 'source<TAB>target', found no tab"):
        all_pairs(DataConfig(corpus=str(tmp_path / "c.tsv")))


def test_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"src": "a", "tgt": "b"}\n{"src": "a", \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:2: not valid JSON"):
        all_pairs(DataConfig(corpus=str(p)))
    p.write_text('{"translation": {"en": "a", "de": "b"}}\n\n{"translation": {"en": "a", "fr": "b"}}\n',
                 encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:3: 'translation' has no key 'de'"):
        all_pairs(DataConfig(corpus=str(p)))
    p.write_text('{"src": "a"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.jsonl:1: record has no key 'tgt'"):
        all_pairs(DataConfig(corpus=str(p)))


def test_documents_text_and_jsonl(tmp_path):
    (tmp_path / "d.txt").write_text("first doc\nline two\n\n\nsecond doc\n\nthird\n", encoding="utf-8")
    docs = [d for ds in docs_of(DataConfig(corpus=str(tmp_path / "d.txt"))).values() for d in ds]
    assert sorted(docs) == sorted(["first doc\nline two", "second doc", "third"])
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.jsonl:2: record has no key 'text'"):
        docs_of(DataConfig(corpus=str(tmp_path / "d.jsonl")))


# ---- splits ---------------------------------------------------------------------------------------------
def test_hash_split_is_deterministic_disjoint_and_sized(data_tsv):
    cfg = DataConfig(corpus=str(data_tsv), valid_fraction=0.05, test_fraction=0.1)
    a, b = pairs_of(cfg), pairs_of(cfg)
    assert a == b
    n = sum(len(v) for v in a.values())
    assert 0.03 < len(a["valid"]) / n < 0.07 and 0.08 < len(a["test"]) / n < 0.12
    srcs = {s: {p[0] for p in v} for s, v in a.items()}
    assert not (srcs["train"] & srcs["valid"]) and not (srcs["train"] & srcs["test"])
    assert all(hash_unit(p[0]) >= 0.15 for p in a["train"])


# ---- Hugging Face datasets ----------------------------------------------------------------------------------
def test_saved_dataset_and_dataset_dict(tmp_path, data_pairs):
    rows = {"translation": [{"en": s, "de": t} for s, t in data_pairs[:200]]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "flat"))
    got = pairs_of(DataConfig(corpus=str(tmp_path / "flat"), valid_fraction=0.1, test_fraction=0.1))
    assert sorted(p for v in got.values() for p in v) == sorted(data_pairs[:200])
    assert got["valid"] and got["test"]  # a single Dataset is split by hash
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"translation": rows["translation"][:150]}),
        "validation": datasets.Dataset.from_dict({"translation": rows["translation"][150:170]}),
        "test": datasets.Dataset.from_dict({"translation": rows["translation"][170:]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    got = pairs_of(DataConfig(corpus="hf:" + str(tmp_path / "dd")))
    assert got["train"] == data_pairs[:150] and got["valid"] == data_pairs[150:170]
    assert got["test"] == data_pairs[170:200]


def test_saved_dataset_missing_language_names_row(tmp_path):
    datasets.Dataset.from_dict({"translation": [{"en": "a", "fr": "b"}]}).save_to_disk(str(tmp_path / "x"))
    with pytest.raises(DataError, match=r"row 0: 'translation' has no key 'de'"):
        all_pairs(DataConfig(corpus=str(tmp_path / "x")))


def test_saved_dataset_of_documents(tmp_path):
    texts = [f"document {i}\nwith two lines" for i in range(2500)]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "docs"))
    cfg = DataConfig(corpus=str(tmp_path / "docs"), text_field="body")
    got = docs_of(cfg)
    assert sorted(d for v in got.values() for d in v) == sorted(texts) and got["valid"] and got["test"]
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body'\]\); set data\.text_field"):
        docs_of(cfg.replace(text_field="text"))
    bad = texts[:1500] + [None] + texts[1500:]  # a null past the first 1000-row batch: its row is named
    datasets.Dataset.from_dict({"text": bad}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"row 1500: 'text' is NoneType, not a string"):
        docs_of(DataConfig(corpus=str(tmp_path / "bad")))


def test_hub_name_offline_fails_fast_with_advice(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network from a test, online or not
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"cannot load Hugging Face dataset .*save_to_disk.*\.tsv/\.jsonl"):
        open_parallel(DataConfig(corpus="hf:attnlab-test/no-such-dataset:de-en"))
    assert time.perf_counter() - t0 < 5.0


# ---- gettext --------------------------------------------------------------------------------------------
def test_mo_parser_handles_header_context_plural_and_charset(tmp_path, data_write_mo):
    mo = data_write_mo(tmp_path / "a.mo", [("File", "Datei"), ("menu\x04_Open", "Ö_ffnen"),
                                           ("%d file\x00%d files", "%d Datei\x00%d Dateien")])
    assert read_mo(mo) == [("File", "Datei"), ("_Open", "Ö_ffnen"), ("%d file", "%d Datei"),
                           ("%d files", "%d Dateien")]
    latin = data_write_mo(tmp_path / "l.mo", [("Size", "Größe")], charset="ISO-8859-1")
    assert read_mo(latin) == [("Size", "Größe")]


def test_gettext_dedup_drops_and_skips_broken_catalogs(tmp_path, data_write_mo, caplog):
    d = tmp_path / "locale" / "de" / "LC_MESSAGES"
    data_write_mo(d / "a.mo", [("Open", "Öffnen"), ("OK", "OK"), ("Quit", ""), ("Save", "Speichern")])
    data_write_mo(d / "b.mo", [("Open", "Öffnen"), ("Open", "Aufmachen"), ("  ", "x")])
    (d / "broken.mo").write_bytes(b"\xde\x12\x04\x95" + b"\0" * 10)
    good = data_write_mo(d / "trunc.mo", [("Close", "Schließen")])
    good.write_bytes(good.read_bytes()[:-12])  # strings cut off
    with caplog.at_level(logging.WARNING, logger="attnlab.data"):
        pairs = gettext_pairs(str(tmp_path / "locale"), "de")
    assert pairs == [("Open", "Öffnen"), ("Save", "Speichern"), ("Open", "Aufmachen")]
    assert "broken.mo" in caplog.text and "trunc.mo" in caplog.text
    with pytest.raises(DataError, match=r"gettext:fr: 0 English->fr pairs in 0 catalog\(s\)\. Searched: .*fr/LC_ME"):
        open_parallel(DataConfig(corpus="gettext:fr", tgt_lang="fr", locale_dir=str(tmp_path / "locale")))


def test_gettext_reads_every_locale_dir_and_stops_below_min_pairs(tmp_path, data_write_mo):
    """Ubuntu keeps language packs in /usr/share/locale-langpack: a list of folders is read in order; a machine
    with too few catalogs stops before anything is trained, saying where it looked and how to install them."""
    debian, ubuntu = tmp_path / "locale", tmp_path / "locale-langpack"
    data_write_mo(debian / "de" / "LC_MESSAGES" / "a.mo", [("Open", "Öffnen"), ("Save", "Speichern")])
    data_write_mo(ubuntu / "de" / "LC_MESSAGES" / "b.mo", [("Save", "Speichern"), ("Quit", "Beenden")])
    cfg = DataConfig(corpus="gettext:de", locale_dir=[str(debian), str(ubuntu)], valid_fraction=0, test_fraction=0)
    assert pairs_of(cfg)["train"] == [("Open", "Öffnen"), ("Save", "Speichern"), ("Quit", "Beenden")]
    assert DataConfig().locale_dir == ["/usr/share/locale", "/usr/share/locale-langpack"]
    with pytest.raises(DataError) as e:
        open_parallel(cfg.replace(min_pairs=4))
    msg = str(e.value)
    assert "3 English->de pairs in 2 catalog(s); data.min_pairs asks for 4" in msg
    assert f"Searched: {debian}/de/LC_MESSAGES, {ubuntu}/de/LC_MESSAGES" in msg
    assert "Debian: sudo apt-get install iso-codes" in msg and "Ubuntu: sudo apt-get install language-pack-de" in msg
    with pytest.raises(DataError, match="language-pack-zh-hans"):
        open_parallel(DataConfig(corpus="gettext:zh_CN", tgt_lang="zh_CN", locale_dir=str(debian)))
    with pytest.raises(ConfigError, match="data.locale_dir"):
        DataConfig(locale_dir=[])


def test_gettext_mono_sides(tmp_path, data_write_mo):
    d = tmp_path / "locale" / "de" / "LC_MESSAGES"
    data_write_mo(d / "a.mo", [("Open", "Öffnen"), ("Open file", "Öffnen"), ("Save", "Speichern")])
    loc = str(tmp_path / "locale")
    de = [x for v in docs_of(DataConfig(corpus="gettext-mono:de", locale_dir=loc)).values() for x in v]
    en = [x for v in docs_of(DataConfig(corpus="gettext-mono:de:en", locale_dir=loc)).values() for x in v]
    assert sorted(de) == ["Speichern", "Öffnen"] and sorted(en) == ["Open", "Open file", "Save"]


def test_gettext_de_demo_corpus(data_locale_de):
    cfg = DataConfig(corpus="gettext:de", locale_dir=str(data_locale_de))
    splits = pairs_of(cfg)
    n = sum(len(v) for v in splits.values())
    assert n > 20_000
    pairs = [p for v in splits.values() for p in v]
    assert len(set(pairs)) == n and all(s != t and s.strip() and t.strip() for s, t in pairs)
    srcs = {k: {s for s, _ in v} for k, v in splits.items()}
    assert not (srcs["train"] & srcs["test"] or srcs["train"] & srcs["valid"] or srcs["valid"] & srcs["test"])
    assert 0.015 < len(splits["test"]) / n < 0.025 and 0.006 < len(splits["valid"]) / n < 0.014
    sources_with_many = Counter(s for s, _ in pairs)
    assert max(sources_with_many.values()) > 1  # one source, several translations: all in the same split
