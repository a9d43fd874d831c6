"""Byte-level BPE (Hugging Face `tokenizers`) with fixed special ids, trained once per corpus + settings.

Text is NFC-normalised, then split GPT-2 style into byte-level pieces. Every byte has a symbol, so nothing is
ever <unk>, and text that spells a special token ("</s>") is encoded as plain text. Hence
`decode(encode(x)) == normalize(x)` exactly, which is `unicodedata.normalize("NFC", x)` but for a few combining
marks newer than the tokenizers library's Unicode tables: BLEU is computed on real text.
No prefix space is added (it would not be removed on decoding).

The ids pad=0, bos=1, eos=2, unk=3 are fixed: the models and the collate functions rely on them. A tokenizer for
masked language modelling also holds <mask>, at id 4, after them (trained with `mask=True`); the others do not, so
their vocabularies, and the tokenizers and token caches saved before <mask> existed, are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from .config import DataError

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
N_BYTES = 256  # the byte-level alphabet: every vocabulary holds all of them
# Beside tokenizer.json, what makes the folder load with transformers.AutoTokenizer: the special tokens' roles, and
# no clean-up of spaces on decoding (it would turn "a ." into "a.", and decoding must give back the text)
_HF_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
              "unk_token": UNK, "clean_up_tokenization_spaces": False, "add_prefix_space": False,
              "split_special_tokens": True}  # text that spells "</s>" stays text, as in attnlab


def hf_files(mask: bool = False) -> dict[str, str]:
    """tokenizer_config.json and special_tokens_map.json (with <mask> as mask_token for a masked-LM tokenizer)."""
    config = {**_HF_CONFIG, **({"mask_token": MASK} if mask else {})}
    return {"tokenizer_config.json": json.dumps(config, indent=1),
            "special_tokens_map.json": json.dumps({k: config[k] for k in config if k.endswith("_token")})}


def encode_as_trained(directory: str | Path, lm: bool) -> None:
    """Make a saved joint tokenizer's Hugging Face files encode text as attnlab's models saw it in training.
    A translation source ends with </s> (as Marian's tokenizer does). A language model's text starts after </s>:
    LM training streams documents each followed by EOS, with no BOS anywhere, so </s> is what precedes a
    document; it is declared as the bos_token, as GPT-2's export does with <|endoftext|>."""
    d = Path(directory)
    tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    single, pair = (f"{EOS} $A", f"{EOS} $A {EOS} $B:1") if lm else (f"$A {EOS}", f"$A {EOS} $B:1 {EOS}:1")
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(EOS, EOS_ID)])
    tok.save(str(d / "tokenizer.json"))
    if lm:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config = json.loads((d / name).read_text(encoding="utf-8"))
            config["bos_token"] = EOS
            (d / name).write_text(json.dumps(config, indent=1), encoding="utf-8")


def check_vocab_size(vocab_size: int, key: str = "data.vocab_size", mask: bool = False) -> None:
    n_special = len(SPECIALS) + mask
    if vocab_size < n_special + N_BYTES:
        raise DataError(f"{key}={vocab_size} is too small: the {n_special} special tokens and the "
                        f"{N_BYTES}-symbol byte alphabet alone need {n_special + N_BYTES}")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, mask: bool = False) -> HFTokenizer:
    """A byte-level BPE trained on `texts` (streamed; only word counts are held in memory); `mask` adds <mask>."""
    check_vocab_size(vocab_size, mask=mask)
    specials = SPECIALS + (MASK,) * mask
    tok = HFTokenizer(models.BPE())  # no unk_token: byte-level coverage makes it unnecessary
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for tid, name in enumerate(specials):  # special tokens are added first, in order: assert it anyway
        if tok.token_to_id(name) != tid:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {tid}")
    return tok


class Tokenizer:
    """Source and target BPE (the same object for a joint vocabulary).

    `encode*` default to the source side and `decode*` to the target side, the way translation uses them;
    pass side="tgt" / side="src" for the other. Encoding adds no special tokens; the collate functions add
    EOS/BOS. Decoding drops special tokens.
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, src: HFTokenizer, tgt: HFTokenizer | None = None) -> None:
        self.src = src
        self.tgt = tgt if tgt is not None else src
        for side, tok in (("src", self.src), ("tgt", self.tgt)):
            # text that spells a special token ("<s>", "</s>" in web text) is encoded as text, never as the
            # special id: else it would end a sentence early and vanish on decoding
            tok.encode_special_tokens = True
            for tid, name in enumerate(SPECIALS):
                if tok.token_to_id(name) != tid:
                    raise DataError(f"{side} tokenizer: {name} has id {tok.token_to_id(name)}, expected {tid}")

    @property
    def mask_id(self) -> int | None:
        """The id of <mask> (4) in a masked-language-modelling tokenizer; None in the others (whose id 4 is an
        ordinary token, and whose BPE may even have learnt the text "<mask>" as one)."""
        special = self.src.get_added_tokens_decoder().get(MASK_ID)  # id -> AddedToken, the special tokens
        return MASK_ID if special is not None and special.content == MASK else None

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def vocab_size(self) -> int:
        """Target vocabulary (= source vocabulary when joint)."""
        return self.tgt.get_vocab_size()

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_vocab_size()

    def _side(self, side: str) -> HFTokenizer:
        if side not in ("src", "tgt"):
            raise ValueError(f"side={side!r}: expected 'src' or 'tgt'")
        return self.src if side == "src" else self.tgt

    def normalize(self, text: str) -> str:
        """What decode(encode(text)) gives back: the NFC form of the text, as the tokenizers library computes it.
        Its Unicode tables can be older than Python's unicodedata: for a few combining marks added since (U+07FD,
        U+0899, ...) the two differ, and this is the form attnlab's models read and write."""
        normalizer = self.src.normalizer
        return normalizer.normalize_str(text) if normalizer is not None else text

    def encode(self, text: str, side: str = "src") -> list[int]:
        return self._side(side).encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], side: str = "src") -> list[list[int]]:
        """Multi-threaded (Rust) batch encoding; `encode_batch_fast` skips offset tracking."""
        return [e.ids for e in self._side(side).encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], side: str = "tgt") -> str:
        return self._side(side).decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_batch(self, batch: Iterable[Iterable[int]], side: str = "tgt") -> list[str]:
        return self._side(side).decode_batch([[int(i) for i in ids] for ids in batch], skip_special_tokens=True)

    def to_files(self) -> dict[str, str]:
        """The tokenizer as file name -> text (what `save` writes and a checkpoint carries, as plain strings):
        tokenizer.json (joint) or src.json + tgt.json, and meta.json."""
        sides = {"tokenizer.json": self.src} if self.joint else {"src.json": self.src, "tgt.json": self.tgt}
        files = {name: tok.to_str() for name, tok in sides.items()}
        specials = SPECIALS + (MASK,) * (self.mask_id is not None)
        meta = {"joint": self.joint, "specials": {name: i for i, name in enumerate(specials)},
                "vocab_size": self.vocab_size, "src_vocab_size": self.src_vocab_size, "normalization": "NFC"}
        files["meta.json"] = json.dumps(meta, indent=1)
        return files

    @classmethod
    def from_files(cls, files: dict[str, str], where: str) -> Tokenizer:
        """Inverse of `to_files`; `where` names the source in errors (a folder, a checkpoint)."""
        try:
            meta = json.loads(files["meta.json"])
            if meta["joint"]:
                return cls(HFTokenizer.from_str(files["tokenizer.json"]))
            return cls(HFTokenizer.from_str(files["src.json"]), HFTokenizer.from_str(files["tgt.json"]))
        except DataError:
            raise
        except Exception as e:  # a missing or corrupt file
            raise DataError(f"{where}: cannot load the tokenizer: {type(e).__name__}: {e}") from None

    def save(self, directory: str | Path) -> Path:
        """to_files() into `directory`, written atomically per file, meta.json last. A joint tokenizer's folder is
        also a Hugging Face one: `transformers.AutoTokenizer.from_pretrained(directory)` loads it with the same
        ids, <pad>/<s>/</s>/<unk> as its pad/bos/eos/unk tokens, and decodes as `decode` does."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        files = self.to_files()
        if self.joint:
            files.update(hf_files(self.mask_id is not None))
        for name in sorted(files, key=lambda n: n == "meta.json"):  # meta.json last: it marks a complete save
            tmp = d / f".{name}.tmp"
            tmp.write_text(files[name], encoding="utf-8")
            tmp.replace(d / name)
        return d

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        d = Path(directory)
        if not (d / "meta.json").is_file():
            raise DataError(f"{d}: not a saved tokenizer (no meta.json)")
        names = ("meta.json", "tokenizer.json", "src.json", "tgt.json")
        return cls.from_files({n: (d / n).read_text(encoding="utf-8") for n in names if (d / n).is_file()}, str(d))

    @classmethod
    def train(cls, src_texts: Iterable[str], tgt_texts: Iterable[str] | None, vocab_size: int,
              min_frequency: int = 2, mask: bool = False) -> Tokenizer:
        """Joint when `tgt_texts` is None (pass both sides through `src_texts`), else one BPE per side. `mask`: a
        joint tokenizer with <mask> (masked language modelling)."""
        if mask and tgt_texts is not None:
            raise ValueError("a <mask> tokenizer is for one text stream: pass tgt_texts=None")
        src = train_bpe(src_texts, vocab_size, min_frequency, mask)
        return cls(src, None if tgt_texts is None else train_bpe(tgt_texts, vocab_size, min_frequency))


def chunked(items: Iterable, size: int) -> Iterator[list]:
    """Lists of up to `size` consecutive items: corpora are encoded in chunks so memory stays flat."""
    buf: list = []
    for x in items:
        buf.append(x)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf
