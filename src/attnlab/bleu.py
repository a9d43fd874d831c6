"""The 2017 papers' tokenised BLEU with compound splitting, beside sacreBLEU.

Two BLEUs are reported for WMT14 English->German, and they are not comparable with each other:

* sacreBLEU on detokenised text (`attnlab.evaluate.score`, with its signature): the figure to compare across
  systems today (Post 2018).
* The figure of Vaswani et al. 2017 (27.3 base, 28.4 big), GNMT and ConvS2S: both sides tokenised with the
  Moses tokenizer, hyphenated compounds split (`rich-text` -> `rich ##AT##-##AT## text`), then BLEU on those
  tokens with multi-bleu.perl. This is what tensor2tensor's `get_ende_bleu.sh` and fairseq's
  `scripts/compound_split_bleu.sh` compute. Each split adds a `##AT##-##AT##` token that matches wherever the
  reference has a compound too, and lets the parts match on their own, so the figure usually comes out
  higher than plain tokenised BLEU.

`compound_split_bleu` reproduces that pipeline with kept tools: sacremoses' port of the Moses tokenizer
(`tokenizer.perl -l de`, escaping on, as the GNMT data script ran it), the same `s{(\\S)-(\\S)}{...}g`
substitution, and sacrebleu with tokenize='none' and no smoothing for the BLEU itself (multi-bleu.perl's
arithmetic: one reference, clipped n-gram counts up to 4, corpus brevity penalty, 0 when any order has no
match).

Two differences from the scripts, both deliberate: the hypothesis and the reference go through the same
tokenizer here (get_ende_bleu.sh compares a freshly tokenised hypothesis with a reference tokenised beforehand
by the GNMT data script, and passes only the hypothesis through replace-unicode-punctuation.perl);
and the input is detokenised text, since attnlab's models read and write raw text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sacrebleu
from sacremoses import MosesTokenizer

from .config import ConfigError

MECAB_EXTRA = "pip install 'attnlab[mecab]'"  # sacreBLEU's ja-mecab and ko-mecab tokenizers need MeCab + dictionary


def target_language(lang: str) -> str:
    """`attnlab bleu --lang`: a language (de, zh_CN, pt-BR), or a pair as sacreBLEU's -l takes it (en-zh: two
    lowercase codes), whose second part is the target. sacreBLEU picks its tokenizer by the target."""
    pair = re.fullmatch(r"[a-z]{2,3}-([a-z]{2,3})", lang)
    return pair.group(1) if pair else lang


def sacrebleu_bleu(tgt_lang: str = "") -> sacrebleu.metrics.BLEU:
    """sacreBLEU's BLEU for text in `tgt_lang`, with the tokenizer its CLI picks for `-l xx-<tgt_lang>`: zh for
    Chinese, ja-mecab for Japanese, ko-mecab for Korean, 13a for every other language (13a would score a
    Chinese or Japanese phrase, written without spaces, as one word). A locale (zh_CN, pt-BR) counts as its
    language. The signature names the tokenizer."""
    lang = re.split(r"[_@.-]", tgt_lang)[0].lower()
    try:
        return sacrebleu.metrics.BLEU(trg_lang=lang)
    except (ImportError, RuntimeError) as e:  # sacreBLEU raises RuntimeError when MeCab or its dictionary is missing
        tokenizer = sacrebleu.metrics.BLEU._TOKENIZER_MAP.get(lang, "?")
        raise ConfigError(f"BLEU on {tgt_lang!r} text uses sacreBLEU's {tokenizer} tokenizer, which needs MeCab and "
                          f"its dictionary: {MECAB_EXTRA} ({type(e).__name__}: {str(e).strip()[:120]})") from None

# perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Perl runs it on bytes, where \S is anything but ASCII
# whitespace; re.ASCII gives the same classes on str. Matches do not overlap, so `a-b-c` becomes
# `a ##AT##-##AT## b-c`, exactly as the scripts leave it.
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)
AT_SPLIT = " ##AT##-##AT## "


def split_compounds(line: str) -> str:
    """`Rich-Text Format` -> `Rich ##AT##-##AT## Text Format` (the ##AT## convention of GNMT and the
    Stanford NMT data). A hyphen with whitespace or a line end on either side is left alone."""
    return _COMPOUND.sub(lambda m: m.group(1) + AT_SPLIT + m.group(2), line)


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Each line through the Moses tokenizer for `lang` (sacremoses), space-joined: `tokenizer.perl -l lang`
    with its defaults (XML escaping on, no aggressive hyphen splitting)."""
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, escape=True, return_str=True) for line in lines]


def _check_pair(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError("hyps and refs are sequences of lines, not single strings")
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references: they must pair up line by line")
    if not refs:
        raise ValueError("no sentences to score")


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str = "de",
                   compound_split: bool = True) -> dict[str, Any]:
    """Moses-tokenised BLEU (multi-bleu.perl arithmetic), with compound splitting unless told otherwise.

    Returns bleu (rounded to 2 places as multi-bleu.perl prints it), the n-gram precisions in percent, the
    brevity penalty, hypothesis and reference lengths in tokens, and a one-line description of the method."""
    _check_pair(hyps, refs)
    sys_tok, ref_tok = moses_tokenize(hyps, lang), moses_tokenize(refs, lang)
    if compound_split:
        sys_tok, ref_tok = [split_compounds(s) for s in sys_tok], [split_compounds(r) for r in ref_tok]
    metric = sacrebleu.metrics.BLEU(tokenize="none", force=True, smooth_method="none")
    b = metric.corpus_score(sys_tok, [ref_tok])
    method = (f"Moses tokenizer (sacremoses, lang={lang}, escaped)"
              + (" + ##AT## compound splitting" if compound_split else "")
              + f" + multi-bleu-style BLEU (sacrebleu tokenize=none, no smoothing: {metric.get_signature()})")
    return {"bleu": round(b.score, 2), "precisions": [round(p, 2) for p in b.precisions], "bp": round(b.bp, 4),
            "hyp_len": b.sys_len, "ref_len": b.ref_len, "sentences": len(hyps), "detail": str(b), "method": method}


def compound_split_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str = "de") -> dict[str, Any]:
    """The paper's BLEU: Moses-tokenised hypotheses and references, hyphenated compounds split, multi-bleu
    arithmetic. `hyps` and `refs` are detokenised lines (what attnlab translate writes, the raw test set)."""
    return tokenized_bleu(hyps, refs, lang, compound_split=True)


def read_text_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file without their terminators ('\\n' or '\\r\\n'). Only newlines end a
    line (str.splitlines would also split at U+2028 and friends, which sentences may contain)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text (byte {e.start}: {e.object[max(0, e.start - 20):e.end + 20]!r})"
                         ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_pair(hyp_path: str | Path, ref_path: str | Path) -> tuple[list[str], list[str]]:
    """Hypothesis and reference files that pair up line by line; a length mismatch names both files."""
    hyps, refs = read_text_lines(hyp_path), read_text_lines(ref_path)
    if len(hyps) != len(refs):
        raise ValueError(f"{hyp_path} has {len(hyps)} lines but {ref_path} has {len(refs)}: "
                         "hypotheses and references must pair up line by line")
    if not refs:
        raise ValueError(f"{ref_path} is empty: nothing to score")
    return hyps, refs
