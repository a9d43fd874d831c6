"""CONTRIBUTING.md stays true of the code: every file path, `attnlab.`/`torch.` name, class, table and test it
puts in backticks exists, and walkthrough (a), a squared-ReLU FFN (So et al. 2021, Primer), works as it says: one
table entry, taken from the document itself, makes `ffn: relu2` a model that computes relu(x)^2, counted exactly."""

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.config import CHOICES, ConfigError, ModelConfig
from attnlab.models import tables
from attnlab.models.accounting import count_parameters
from attnlab.models.transformer import build_model

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PATH = re.compile(r"^[\w./-]+(/|\.(py|md|yaml|yml|toml|txt))$")
NAME = re.compile(r"^(?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\[\"(?P<key>\w+)\"\])?$")


def inline_code() -> list[str]:
    prose = FENCED.sub("", DOC)
    return re.findall(r"`([^`\n]+)`", prose)


def resolve(dotted: str):
    """Import the longest importable module prefix of `dotted`, then follow the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # AttributeError: the document names something that is not there
        return obj
    raise ImportError(dotted)


def test_every_backticked_path_exists():
    paths = [c for c in inline_code() if PATH.match(c)]
    assert len(paths) >= 10  # the walkthroughs name their files
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"


def test_every_backticked_name_resolves():
    names = [m for c in inline_code() if (m := NAME.match(c)) and not PATH.match(c)]
    assert len(names) >= 10
    for m in names:
        assert m["dotted"].split(".")[0] in ("attnlab", "torch"), (
            f"write `{m['dotted']}` fully qualified (attnlab.<module>.<name>) so that it can be checked")
        obj = resolve(m["dotted"])
        if m["key"]:
            assert m["key"] in obj, f"{m['dotted']} has no entry {m['key']!r}"


def test_every_backticked_class_table_and_test_name_is_defined():
    """Bare names the document uses: a class (CamelCase), a table (UPPER_CASE) or a test (test_*) is defined at the
    top of a module in src/ or tests/ (a class, a def or an assignment)."""
    wanted = {c for c in inline_code() if re.fullmatch(r"[A-Z][a-z]\w*|[A-Z][A-Z0-9_]+|test_\w+", c)}
    assert {"Block", "LAYOUT", "ACTIVATION_FORMULAS"} <= wanted
    sources = "\n".join(f.read_text(encoding="utf-8") for d in ("src", "tests") for f in (ROOT / d).rglob("*.py"))
    missing = [n for n in sorted(wanted) if not re.search(rf"^(?:def |class ){n}\b|^{n}\s*[:=]", sources, re.M)]
    assert not missing, f"CONTRIBUTING.md names things that are not defined: {missing}"


def relu2_entry() -> tables.Activation:
    """The table entry exactly as walkthrough (a) writes it, evaluated where it goes: in tables.py."""
    blocks = [body for lang, body in FENCED.findall(DOC) if lang == "python" and '"relu2"' in body]
    assert len(blocks) == 1, "walkthrough (a) shows the relu2 table entry in one python block"
    entry = eval("{" + blocks[0] + "}", vars(tables))  # noqa: S307 - our own document
    assert list(entry) == ["relu2"]
    return entry["relu2"]


@pytest.mark.parametrize("arch", list(CHOICES["arch"]))
def test_walkthrough_a_one_table_entry_makes_a_relu2_model(arch, monkeypatch):
    with pytest.raises(ConfigError, match="model.ffn='relu2'"):
        ModelConfig(ffn="relu2")
    monkeypatch.setitem(tables.ACTIVATIONS, "relu2", relu2_entry())  # the one step of the walkthrough
    assert "relu2" in CHOICES["ffn"]

    cfg = ModelConfig(arch=arch, ffn="relu2", vocab_size=31, d_model=16, n_heads=2, n_enc_layers=2, n_dec_layers=2,
                      dropout=0.0, max_seq_len=32)
    assert not cfg.gated and cfg.ffn_dim == 4 * cfg.d_model
    torch.manual_seed(0)
    model = build_model(cfg)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters())

    ids = torch.randint(4, 31, (2, 6), generator=torch.Generator().manual_seed(0))  # (B, T)
    out = model(ids, ids) if arch == "encoder_decoder" else model(ids)  # (B, T, V)
    assert out.shape == (2, 6, 31) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    stack = model.decoder if arch != "encoder_only" else model.encoder
    ffn = stack.layers[0].ffn
    with torch.no_grad():
        for p in ffn.parameters():  # biases off 0 too, so a mis-wired bias shows
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        x = torch.randn(2, 5, 16)  # (B, T, d)
        pre = F.linear(x, ffn.fc1.weight, ffn.fc1.bias)  # (B, T, 4d)
        want = F.linear(pre.clamp(min=0) ** 2, ffn.fc2.weight, ffn.fc2.bias)  # fc2(relu(fc1 x)^2), Primer
        plain = F.linear(pre.clamp(min=0), ffn.fc2.weight, ffn.fc2.bias)
        got = ffn(x)  # (B, T, d)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain, atol=1e-3)  # the square matters on these weights
