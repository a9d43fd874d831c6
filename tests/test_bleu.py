"""The paper's tokenised BLEU with compound splitting (attnlab.bleu) and `attnlab bleu`, on hand-made cases.

Every expected value is worked out by hand in the comment beside it, from BLEU's definition as multi-bleu.perl
computes it: clipped n-gram precisions p1..p4 over the corpus, BP = exp(1 - r/c) when c < r,
BLEU = 100 * BP * (p1 p2 p3 p4)^(1/4), and 0 when any order has no match.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.bleu import compound_split_bleu, read_pair, read_text_lines, split_compounds, tokenized_bleu
from attnlab.cli import main


# ------------------------------------------------------------------------------------------ compound splitting
@pytest.mark.parametrize("line, expected", [
    ("rich-text format", "rich ##AT##-##AT## text format"),
    ("Müller-Lüdenscheidt", "Müller ##AT##-##AT## Lüdenscheidt"),
    ("E-Mail-Adresse", "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # matches do not overlap: `b` went with the first one, as in perl's s///g
    ("a--b", "a ##AT##-##AT## -b"),
    ("3-4", "3 ##AT##-##AT## 4"),
    ("- x", "- x"), ("x -", "x -"), ("x - y", "x - y"), ("-x", "-x"), ("x-", "x-"),
])
def test_split_compounds(line: str, expected: str) -> None:
    assert split_compounds(line) == expected


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl is not installed")
def test_split_compounds_matches_the_scripts_perl_one_liner() -> None:
    """The substitution of get_ende_bleu.sh / compound_split_bleu.sh, run by perl itself on bytes."""
    lines = ["a-b-c a--b ---", "Müller-Lüdenscheidt und E-Mail-Adresse", "x\u00a0-y z-\u00a0w", "«Nord»-Süd 1-2-3-4",
             "- leading and trailing -", "tab\t-\tsep", "ä-ö ß-ü", ""]
    out = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, encoding="utf-8", check=True).stdout
    assert out.split("\n")[:-1] == [split_compounds(line) for line in lines]


# ------------------------------------------------------------------------------------------ the BLEU itself
def test_identical_text_scores_100() -> None:
    sents = ["Die Rich-Text-Formate sind „gut“, sagte er.", "Das kostet 3,50 Euro (inkl. MwSt.) pro E-Mail-Adresse."]
    r = compound_split_bleu(sents, sents)
    assert r["bleu"] == 100.0
    assert r["precisions"] == [100.0] * 4 and r["bp"] == 1.0
    assert r["sentences"] == 2


def test_a_split_compound_adds_matching_tokens() -> None:
    hyps, refs = ["die E-Mail kommt"], ["die E-Mail kam"]
    # Without splitting: [die, E-Mail, kommt] vs [die, E-Mail, kam]: p3 = 0/1, so BLEU = 0.
    plain = tokenized_bleu(hyps, refs, compound_split=False)
    assert plain["hyp_len"] == 3 and plain["precisions"][:3] == [pytest.approx(66.67), 50.0, 0.0]
    assert plain["bleu"] == 0.0
    # Split: [die, E, ##AT##-##AT##, Mail, kommt] vs [die, E, ##AT##-##AT##, Mail, kam]:
    # p1 = 4/5, p2 = 3/4, p3 = 2/3, p4 = 1/2, c = r = 5: BLEU = 100 * (0.8 * 0.75 * 2/3 * 0.5)^(1/4) = 100 * 0.2^0.25
    split = compound_split_bleu(hyps, refs)
    assert split["hyp_len"] == 5 and split["ref_len"] == 5
    assert split["precisions"] == [80.0, 75.0, pytest.approx(66.67), 50.0]
    assert split["bleu"] == round(100 * 0.2 ** 0.25, 2) == 66.87


def test_precisions_are_clipped_and_a_missing_order_gives_zero() -> None:
    # [die, die, die, Katze] vs [die, Katze, schläft]: `die` counts at most once (clipped): p1 = 2/4;
    # bigrams (die die) (die die) (die Katze): p2 = 1/3; trigrams: p3 = 0/2 -> BLEU 0; c = 4 > r = 3 -> BP = 1.
    r = compound_split_bleu(["die die die Katze"], ["die Katze schläft"])
    assert r["precisions"] == [50.0, pytest.approx(33.33), 0.0, 0.0]
    assert r["bp"] == 1.0 and r["bleu"] == 0.0
    # One identical word: p1 = 1/1 but no bigram at all -> 0, as multi-bleu.perl gives (no smoothing).
    assert compound_split_bleu(["ja"], ["ja"])["bleu"] == 0.0


def test_brevity_penalty_and_corpus_level_counts() -> None:
    hyps = ["der Hund bellt laut .", "die Katze schläft"]
    refs = ["der Hund bellt laut .", "die Katze schläft heute ."]
    # Every hypothesis n-gram matches: p1 = 8/8, p2 = 6/6, p3 = 4/4, p4 = 2/2 (summed over both sentences).
    # c = 5 + 3 = 8, r = 5 + 5 = 10: BP = exp(1 - 10/8) = exp(-0.25), BLEU = 100 * exp(-0.25) = 77.88.
    r = compound_split_bleu(hyps, refs)
    assert r["precisions"] == [100.0] * 4
    assert (r["hyp_len"], r["ref_len"]) == (8, 10)
    assert r["bp"] == round(math.exp(-0.25), 4)
    assert r["bleu"] == round(100 * math.exp(-0.25), 2) == 77.88


def test_both_sides_are_moses_tokenised() -> None:
    # Raw punctuation and pre-split punctuation give the same tokens on both sides, escaping included (" -> &quot;).
    raw, split = ['Hallo, Welt! Er sagte: "Ja."'], ['Hallo , Welt ! Er sagte : " Ja . "']
    assert compound_split_bleu(raw, split)["bleu"] == 100.0
    assert tokenized_bleu(raw, split)["hyp_len"] == 11  # Hallo , Welt ! Er sagte : &quot; Ja . &quot;
    # A German comma inside a number stays one token: [Es, kostet, 3,50, Euro, .] has 5 tokens.
    assert compound_split_bleu(["Es kostet 3,50 Euro."], ["Es kostet 3,50 Euro."])["hyp_len"] == 5


def test_input_errors() -> None:
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        compound_split_bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no sentences"):
        compound_split_bleu([], [])
    with pytest.raises(TypeError, match="sequences of lines"):
        compound_split_bleu("eine Zeile", "eine Zeile")


# ------------------------------------------------------------------------------------------ files and the CLI
def test_read_text_lines_splits_on_newlines_only(tmp_path) -> None:
    f = tmp_path / "x.txt"
    f.write_bytes("eins\r\nzwei\u2028drei\n\nvier".encode())
    assert read_text_lines(f) == ["eins", "zwei\u2028drei", "", "vier"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe broken\n")
    with pytest.raises(ValueError, match="bad.txt: not UTF-8"):
        read_text_lines(bad)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_text_lines(tmp_path / "missing.txt")


def test_read_pair_names_both_files_on_a_length_mismatch(tmp_path) -> None:
    (tmp_path / "h.de").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "r.de").write_text("a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"h\.de has 2 lines but .*r\.de has 1"):
        read_pair(tmp_path / "h.de", tmp_path / "r.de")


def test_cli_bleu_prints_and_writes_both_bleus(tmp_path, capsys) -> None:
    hyp, ref, out = tmp_path / "hyp.de", tmp_path / "ref.de", tmp_path / "scores.json"
    hyp.write_text("die E-Mail kommt\n", encoding="utf-8")
    ref.write_text("die E-Mail kam\n", encoding="utf-8")
    assert main(["bleu", "--hyp", str(hyp), "--ref", str(ref), "--compound-split", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok:13a" in printed  # the sacreBLEU signature
    assert "BLEU = 66.87" in printed and "compound splitting" in printed
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["compound_split"]["bleu"] == 66.87
    # sacreBLEU's 13a tokenizer keeps `E-Mail` whole: 3 hypothesis tokens, no 4-gram at all, so BLEU = 0 there
    assert saved["bleu"] == 0.0 and saved["sentences"] == 1 and "bleu_signature" in saved
    # without --compound-split only sacreBLEU and chrF
    assert main(["bleu", "--hyp", str(hyp), "--ref", str(ref)]) == 0
    assert "compound" not in capsys.readouterr().out


def test_cli_bleu_lang_takes_a_language_or_sacrebleus_pair_by_its_target(tmp_path, capsys) -> None:
    """--lang en-zh is sacreBLEU's -l pair: the target (zh) picks the tokenizer, as `sacrebleu -l en-zh` does;
    zh-en scores English (13a); a locale (zh_CN, zh-TW) is its language."""
    hyp, ref = tmp_path / "hyp.zh", tmp_path / "ref.zh"
    hyp.write_text("我很喜欢这只猫。\n", encoding="utf-8")
    ref.write_text("我很喜欢那只猫。\n", encoding="utf-8")
    for lang, tok in (("en-zh", "zh"), ("zh-en", "13a"), ("zh_CN", "zh"), ("zh-TW", "zh"), ("zh", "zh")):
        assert main(["bleu", "--hyp", str(hyp), "--ref", str(ref), "--lang", lang]) == 0
        assert f"tok:{tok}|" in capsys.readouterr().out, lang
    cli = shutil.which("sacrebleu", path=str(Path(sys.executable).parent))
    assert cli, "sacreBLEU's command line comes with it"  # the same score as sacreBLEU's own command line
    theirs = subprocess.run([cli, str(ref), "-i", str(hyp), "-l", "en-zh", "-b", "-w", "2"], capture_output=True,
                            text=True, check=True).stdout.strip()
    main(["bleu", "--hyp", str(hyp), "--ref", str(ref), "--lang", "en-zh"])
    assert f"BLEU = {theirs} " in capsys.readouterr().out and float(theirs) > 20


def test_cli_bleu_errors_name_the_files(tmp_path, capsys) -> None:
    (tmp_path / "h.de").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "r.de").write_text("a\n", encoding="utf-8")
    assert main(["bleu", "--hyp", str(tmp_path / "h.de"), "--ref", str(tmp_path / "r.de")]) == 2
    assert "h.de has 2 lines" in capsys.readouterr().err
    assert main(["bleu", "--hyp", str(tmp_path / "none.de"), "--ref", str(tmp_path / "r.de")]) == 2
    assert "none.de" in capsys.readouterr().err
