"""Byte-level BPE: fixed special ids, exact round trip (the whole demo corpus), save/load, separate vocabularies."""

from __future__ import annotations

import unicodedata

import pytest

from attnlab.data import BOS_ID, EOS_ID, PAD_ID, UNK_ID, DataConfig, DataError, Tokenizer, TranslationDataModule
from attnlab.data.gettext import gettext_pairs

TRICKY = ["", " leading and trailing ", "tabs\tand\nnewlines\r\n", "Cafe\u0301 (NFD) vs Café", "emoji 🦀👍🏽",
          "日本語のテキスト", "zero\u200bwidth", "  multiple   spaces  ", "_File &Open %s %1$d", "Größe ß ẞ",
          "HTML <s>struck</s>, a literal <pad> and <unk>"]


def test_special_ids_are_fixed(data_pairs):
    tok = Tokenizer.train([s for p in data_pairs for s in p], None, vocab_size=400)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert [tok.src.token_to_id(t) for t in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert tok.vocab_size == 400 and tok.joint
    ids = tok.encode(data_pairs[0][0])
    assert ids and min(ids) > UNK_ID  # encoding adds no specials, and never needs <unk>
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == data_pairs[0][0]  # decoding drops specials
    spelled = tok.encode("a </s> b <s>")  # text that spells a special token is text, not the special id
    assert min(spelled) > UNK_ID and tok.decode(spelled) == "a </s> b <s>"


def test_round_trip_is_exact_after_nfc(data_pairs):
    tok = Tokenizer.train([s for p in data_pairs for s in p], None, vocab_size=400)
    texts = TRICKY + [s for p in data_pairs[:200] for s in p]
    assert tok.decode_batch(tok.encode_batch(texts)) == [unicodedata.normalize("NFC", t) for t in texts]
    assert tok.normalize("Cafe\u0301") == "Café" != "Cafe\u0301"
    # a combining mark newer than the tokenizers library's Unicode tables: normalize is what decoding gives back
    newer = "a\u07fd\u0301b"
    assert tok.decode(tok.encode(newer)) == tok.normalize(newer)
    assert [tok.encode(t) for t in texts[:5]] == tok.encode_batch(texts[:5])


def test_vocab_too_small_is_an_error(data_tsv, tmp_path):
    with pytest.raises(DataError, match=r"data\.vocab_size=100 is too small: .*need 260"):
        Tokenizer.train(["a b c"], None, vocab_size=100)
    dm = TranslationDataModule(DataConfig(corpus=str(data_tsv), data_dir=str(tmp_path / "c"), vocab_size=259))
    with pytest.raises(DataError, match=r"vocab_size=259 is too small"):
        dm.prepare_data()
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("manifest.json"))


def test_save_load_and_separate_vocabularies(data_pairs, tmp_path):
    tok = Tokenizer.train((s for s, _ in data_pairs), (t for _, t in data_pairs), vocab_size=300)
    assert not tok.joint
    # English words come out shorter with the English BPE than with the German one, and vice versa
    s = data_pairs[1][0]
    assert len(tok.encode(s, side="src")) < len(tok.encode(s, side="tgt"))
    tok.save(tmp_path / "tok")
    again = Tokenizer.load(tmp_path / "tok")
    assert not again.joint and again.encode(s) == tok.encode(s)
    assert again.decode(again.encode(data_pairs[1][1], side="tgt")) == data_pairs[1][1]
    with pytest.raises(DataError, match="not a saved tokenizer"):
        Tokenizer.load(tmp_path)


@pytest.mark.slow
def test_round_trip_whole_demo_corpus(data_locale_de, tmp_path):
    """Every string of gettext:de, both sides, decodes back to its NFC form (BLEU is computed on real text)."""
    pairs = gettext_pairs(str(data_locale_de), "de")
    dm = TranslationDataModule(DataConfig(corpus="gettext:de", locale_dir=str(data_locale_de),
                                          data_dir=str(tmp_path)))
    dm.prepare_data()
    tok = dm.tokenizer
    for side, texts in (("src", [s for s, _ in pairs]), ("tgt", [t for _, t in pairs])):
        decoded = tok.decode_batch(tok.encode_batch(texts, side=side), side=side)
        bad = [(t, d) for t, d in zip(texts, decoded, strict=True) if d != tok.normalize(t)]
        assert not bad, f"{len(bad)} of {len(texts)} {side} strings do not round-trip, e.g. {bad[:3]}"
    assert len(pairs) > 20_000
