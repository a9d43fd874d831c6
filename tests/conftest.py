"""Shared fixtures. Data fixtures are named data_*."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

LOCALE_DE = Path("/usr/share/locale/de/LC_MESSAGES")
# the closing line of skips by reason; pytester for its own test; the real PostgreSQL server every module shares
pytest_plugins = ["skip_summary", "pytester", "pg_server"]


def apt_install_or_skip(why: str, packages: list[str], suite: str) -> None:
    """Install Debian packages a suite needs (a real SLURM cluster, a real PostgreSQL server) when this machine
    can: Linux, root, apt-get. Otherwise, or when the install fails, skip saying why (`why`: what is missing)."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"{why}; the {suite} tests run on Linux only")
    if os.geteuid() != 0:
        pytest.skip(f"{why} and this user is not root, so it cannot install it (apt-get install {' '.join(packages)})")
    if shutil.which("apt-get") is None:
        pytest.skip(f"{why} and there is no apt-get to install it with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    # one install at a time: pytest-xdist's workers may ask at once, and dpkg's own lock fails the second
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / "attnlab-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode != 0:  # stale package lists: update once and try again
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
            r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"{why} and `{' '.join(install)}` failed: {(r.stderr or r.stdout)[-500:]}")


# Under pytest-xdist (make test TEST_WORKERS=4: -n 4 --dist loadgroup), each test file is one group, run by one
# worker in its own order, its module fixtures (a SLURM cluster, a reference fit) made once; a test's own
# xdist_group marker puts it in that group instead. Groups go out in the files' order: handing the longest out
# first took 28:46 against 26:56 in the files' order (eight CPU-bound groups at once on 2 cores; the two runs'
# logs are bench/results/suite_xdist_*_2026-12-08.log).
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

_EN = ("the a small big red green house cat dog tree river city open close file save print window "
       "error value cannot find read write new old user system network").split()
_DE = ("der die das klein gross rot gruen Haus Katze Hund Baum Fluss Stadt offen schliessen Datei speichern "
       "drucken Fenster Fehler Wert kann nicht finden lesen schreiben neu alt Benutzer System Netzwerk").split()


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n distinct synthetic (English, German) pairs: a word-for-word 'translation' plus a number."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(2, 12)
        idx = [rng.randrange(len(_EN)) for _ in range(k)]
        out.append((" ".join(_EN[j] for j in idx) + f" {i}.", " ".join(_DE[j] for j in idx) + f" {i}."))
    return out


def write_mo(path: Path, entries: list[tuple[str, str]], charset: str = "UTF-8") -> Path:
    """A compiled gettext catalog (little-endian .mo) with a header entry; msgids may hold \\x04 / \\x00."""
    header = f"Content-Type: text/plain; charset={charset}\nPlural-Forms: nplurals=2; plural=(n != 1);\n"
    items = [(b"", header.encode("ascii"))] + [(s.encode(charset), t.encode(charset)) for s, t in entries]
    n = len(items)
    orig_at, trans_at = 28, 28 + 8 * n
    data_at = 28 + 16 * n
    blob, otab, ttab = b"", [], []
    for s, _ in items:
        otab.append((len(s), data_at + len(blob)))
        blob += s + b"\0"
    for _, t in items:
        ttab.append((len(t), data_at + len(blob)))
        blob += t + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, orig_at, trans_at, 0, 0)
    body = b"".join(struct.pack("<2I", *e) for e in otab) + b"".join(struct.pack("<2I", *e) for e in ttab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + body + blob)
    return path


def jitter(model: nn.Module, seed: int = 1, scale: float = 0.1) -> nn.Module:
    """Move every parameter off its init (zero biases, unit norms) so that each one matters: a bias dropped or a norm
    skipped in one code path then changes its outputs. A tied table is one parameter, jittered once."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


@pytest.fixture
def no_hang():
    """Fails a test whose forked decoding workers are still alive after 300 s, killing them (their pool then
    raises BrokenProcessPool in the test): a child that hangs (GNU OpenMP after a fork) would otherwise hold CI
    until its own limit. A last resort, sized for a loaded machine: such a test takes seconds alone."""
    killed: list[list[multiprocessing.Process]] = []

    def kill() -> None:
        killed.append(multiprocessing.active_children())
        for p in killed[0]:
            p.kill()

    timer = threading.Timer(300, kill)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
    if killed:
        pytest.fail(f"forked workers still running after 300 s were killed: {killed[0]}")


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread for every in-process test: the models are tiny, and on CI's 2 shared cores several
    threads thrash (a tiny training step measured 40x slower with 2 threads than with 1 on a loaded machine).
    Subprocesses (the CLI, DDP, SLURM tests) keep torch's default."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def data_pairs() -> list[tuple[str, str]]:
    return make_pairs(3000)


@pytest.fixture
def data_tsv(tmp_path: Path, data_pairs: list[tuple[str, str]]) -> Path:
    p = tmp_path / "corpus.tsv"
    p.write_text("".join(f"{s}\t{t}\n" for s, t in data_pairs), encoding="utf-8")
    return p


@pytest.fixture
def data_write_mo() -> Callable[..., Path]:
    return write_mo


@pytest.fixture
def data_locale_de() -> Path:
    """The machine's German catalogs (the demo corpus); skips where they are not installed."""
    if not LOCALE_DE.is_dir() or not any(LOCALE_DE.glob("*.mo")):
        pytest.skip(f"no German gettext catalogs in {LOCALE_DE} (install a German language pack)")
    return LOCALE_DE.parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    """A joint byte-level BPE of 320 tokens on 400 synthetic pairs: the export tests' random models use it."""
    from attnlab.data.tokenizer import Tokenizer

    pairs = make_pairs(400)
    return Tokenizer.train([t for pair in pairs for t in pair], None, 320)


@pytest.fixture
def data_make_pairs() -> Callable[..., list[tuple[str, str]]]:
    return make_pairs
