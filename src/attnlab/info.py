"""What `attnlab info` prints beyond the counts: the model config a recipe will train (its vocabulary as fit gives
it) and, for a recipe with a published parameter count, how this count compares."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config import ModelConfig, load_yaml
from .experiment import load_experiment
from .models.accounting import count_parameters

# Parameter counts published for shipped recipes, keyed by recipe name: (count, where, embedding-table rows the
# publication's code allocated, what is known). Vaswani et al. count 65M (base) and 213M (big) with "a shared
# source-target vocabulary of about 37000 tokens"; their code, tensor2tensor's wmt_ende_bpe32k problem
# (problem_hparams.py, 2017), read vocab.bpe.32000 into a table of 40,960 rows. Lukasz Kaiser in
# tensorflow/tensor2tensor issue #55: "unluckily it's called bpe32k but it contains about 40000 word-pieces".
# tests/test_paper_recipes.py checks the claim in _T2T_ROWS against Table 3.
_T2T_ROWS = ("the paper's code (tensor2tensor's wmt_ende_bpe32k problem) allocated 40,960 embedding rows for its "
             "~37k BPE vocabulary (t2t issue #55), and with 40,960 rows Table 3's base and (C) rows all round to "
             "their published counts, big's does not")
PUBLISHED_PARAMS: dict[str, tuple[float, str, int, str]] = {
    "wmt14_en_de_base": (65e6, "Vaswani et al. 2017, Table 3", 40960, _T2T_ROWS),
    "wmt14_en_de_big": (213e6, "Vaswani et al. 2017, Table 3", 40960, _T2T_ROWS),
}


def info_config(path: str) -> tuple[ModelConfig, str, str | None]:
    """(model config, where its vocabulary comes from, recipe name or None) for `attnlab info`.

    A bare model YAML is sized as written. A recipe is sized with the vocabulary fit will give it: the
    tokenizer has exactly data.vocab_size entries (one BPE shared by both sides when data.joint_vocab, else one
    per side, of that size each), and fit copies it into the model as train.resolve_model does."""
    raw = load_yaml(Path(path))
    if not any(k in raw for k in ("model", "data", "base")):
        cfg = ModelConfig.from_dict(raw)
        return cfg, f"model.vocab_size={cfg.vocab_size:,}", None
    exp = load_experiment(path)
    changes: dict[str, Any] = {"vocab_size": exp.data.vocab_size, "src_vocab_size": 0}  # as resolve_model
    if exp.task in ("lm", "mlm"):
        changes["max_seq_len"] = max(exp.model.max_seq_len, exp.data.seq_len)
        kind = "BPE"
    else:
        kind = "joint source-target BPE" if exp.data.joint_vocab else "source BPE and target BPE of that size each"
    return exp.model.replace(**changes), f"data.vocab_size={exp.data.vocab_size:,} ({kind})", exp.name


def published_comparison(cfg: ModelConfig, total: int, name: str | None) -> list[str]:
    """Lines comparing `total` with the published count of recipe `name` (none if it has none): the difference,
    the embedding-table size the published figure implies, and the count with the publication's table size."""
    if name not in PUBLISHED_PARAMS:
        return []
    published, where, rows, known = PUBLISHED_PARAMS[name]
    per_row = count_parameters(cfg.replace(vocab_size=cfg.vocab_size + 1))["total"] - total
    # the row counts whose total rounds to the published millions: from 0.5M below it to just under 0.5M above
    lo, hi = (cfg.vocab_size + math.ceil((published + s * 0.5e6 - total) / per_row) - (s > 0) for s in (-1, 1))
    with_rows = count_parameters(cfg.replace(vocab_size=rows))["total"]
    fits = round(with_rows / 1e6) == round(published / 1e6)
    lines = [
        f"paper: {published / 1e6:.0f}M ({where}); this recipe: {total / 1e6:.2f}M ({(total - published) / 1e6:+.2f}M)",
        f"  if only the embedding table differs ({per_row:,} parameters a row), a count that rounds to "
        f"{published / 1e6:.0f}M needs {lo:,.0f}-{hi:,.0f} rows, against {cfg.vocab_size:,} here",
        f"  reported: {known}",
        f"  with {rows:,} rows this recipe has {with_rows / 1e6:.2f}M: "
        + (f"it rounds to the paper's {published / 1e6:.0f}M, consistent with the layers agreeing and only the "
           f"table's size differing" if fits else
           f"not {published / 1e6:.0f}M either: the table's size does not explain the published count"),
    ]
    return lines
