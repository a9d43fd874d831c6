"""What the training and decoding benchmarks share: device and size choice, the matmul peak measured in the same
process, timing with device syncs, peak memory, peers that may be missing, and the result table.

Every benchmark row runs in its own try block: a peer whose package is missing is reported as skipped with
the reason, and any other failure as failed with its error, so one broken row never costs the others
(device time is scarce).

Every JSON a benchmark writes carries its `provenance` (`PROVENANCE_KEYS`): the commit and whether the tree
differed from it, the device, the NVIDIA driver, the versions of torch, CUDA, transformers and CTranslate2, the
command line and the start and end in UTC. `write_json` (the row tables) and `write_record` (any other dict) add
it; bench/results.py refuses a raw file that lacks it."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


@dataclasses.dataclass
class Env:
    device: torch.device
    small: bool
    amp: torch.dtype | None  # autocast dtype for training (bf16 on CUDA), None = fp32
    peak_flops: float  # measured matmul FLOP/s: bf16 on CUDA, fp32 on CPU
    started: float = dataclasses.field(default_factory=time.time)  # Unix time before the first row: provenance

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        if self.cuda:
            name = torch.cuda.get_device_name(self.device)
            kind = "bf16 8192^3"
        else:
            name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} thread(s)"
            kind = "fp32 512^3"
        return (f"device: {name}; torch {torch.__version__}; python {platform.python_version()}; "
                f"{'small' if self.small else 'full'} size; matmul peak ({kind}) {self.peak_flops / 1e12:.2f} TFLOP/s")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true", help="small sizes on the CPU (fp32): runs anywhere in seconds")
    p.add_argument("--size", choices=["full", "small"], help="default: full on CUDA, small on a CPU")
    p.add_argument("--only", default="", help="rows to run, comma-separated: task/model, or prefixes ending in / or *")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    p.add_argument("--threads", type=int, default=1, help="CPU threads on a CPU run (default 1)")


def make_env(args: argparse.Namespace) -> Env:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    small = args.size == "small" if args.size else not cuda
    if not cuda:
        torch.set_num_threads(args.threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (optimizer, fp32 leftovers) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    return Env(device, small, torch.bfloat16 if cuda else None, matmul_peak(device))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a large square matmul: bf16 8192^3 on CUDA (the MFU denominator), fp32 512^3 on a CPU."""
    n, dtype, reps = (8192, torch.bfloat16, 10) if device.type == "cuda" else (512, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def time_steps(step: Callable[[], Any], warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """(seconds of the warm-up steps, which include compiling; mean seconds per timed step)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    t1 = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return t1 - t0, (time.perf_counter() - t1) / iters


def median_us(fn: Callable[[], Any], iters: int) -> float:
    """The median wall time of `iters` calls of a CPU function, in microseconds, after iters // 10 (3 at least)
    warm-up calls."""
    for _ in range(max(iters // 10, 3)):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def kernel_bench(argv: list[str] | None, script: str, doc: str, names: tuple[str, ...], default_shapes: list[tuple],
                 measure: Callable[..., dict], columns: list[tuple[str, str]], default_iters: int) -> int:
    """The main of a CPU kernel benchmark (cpu_linear.py, cpu_argmax.py): one row per shape (named `names`),
    `measure(*shape, iters)` under no_grad at --threads, the table of `columns`, and with --json the rows and
    their provenance. Exits 1 where a row did not run or its `same` figure is False."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=default_iters)
    p.add_argument("--shapes", default="", help=f"{','.join(names)};... (default: the decoding shapes above)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")] if args.shapes else default_shapes
    rows: list[dict] = []
    with torch.no_grad():
        for shape in shapes:
            run_row(rows, {**dict(zip(names, shape, strict=True)), "threads": args.threads},
                    lambda shape=shape: measure(*shape, args.iters))
    print_table(rows, columns + [("status", "status")])
    if args.json:
        write_record(args.json, {"command": f"python bench/{script} " + " ".join(argv), "rows": rows},
                     [f"bench/{script}", *argv], "cpu", started)
    return 0 if all(r["status"] == "ok" and r.get("same", True) for r in rows) else 1


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # compiled graphs of the previous model: its memory and the recompile limits


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class Missing(Exception):
    """A peer that cannot run here (its package is not installed): the row is skipped, not failed."""


def need(module: str, hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Missing(f"{module} not installed ({hint}): {e}") from None


def selected(name: str, only: str) -> bool:
    """Is row `name` (task/model) among `only`: exact names, or prefixes ending in / or * (encdec/, lm/attnlab*)."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return not wanted or any(name == w or (w[-1] in "/*" and name.startswith(w.rstrip("*"))) for w in wanted)


def run_row(rows: list[dict], base: dict, fn: Callable[[], dict]) -> None:
    """Run one measurement; record its figures, or skipped / failed with the reason. Prints as it goes."""
    row = dict(base)
    try:
        row.update(fn())
        row["status"] = "ok"
    except Missing as e:
        row["status"] = f"skipped: {e}"
    except Exception as e:  # one failing row must not cost the others their device time
        traceback.print_exc(file=sys.stderr)
        row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    rows.append(row)
    print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of `columns` (key, header); end it with ("status", ...) to show rows that did not run."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            cells.append("-" if v is None else _fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: Path | None, env: Env, rows: list[dict], argv: list[str]) -> None:
    """The rows of a benchmark table, with the run's `env` line, command and provenance."""
    if path is None:
        return
    write_record(path, {"env": env.describe(), "command": " ".join(argv), "rows": rows}, argv, env.device,
                 env.started)


# ------------------------------------------------------------------------------------------------ provenance
PROVENANCE_KEYS = ("git_commit", "git_dirty", "device", "nvidia_driver", "torch", "cuda", "transformers",
                   "ctranslate2", "python", "argv", "started_utc", "ended_utc")
REPO = Path(__file__).resolve().parents[1]


def write_record(path: Path, record: dict, argv: list[str], device: torch.device | str | None = None,
                 started: float | None = None) -> None:
    """`record` as JSON at `path`, with `provenance(argv, device, started)` added under "provenance"."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {**record, "provenance": provenance(argv, device, started)}
    path.write_text(json.dumps(out, indent=1), encoding="utf-8")


def provenance(argv: list[str], device: torch.device | str | None = None, started: float | None = None) -> dict:
    """Where a result comes from (`PROVENANCE_KEYS`), None for what this machine cannot tell:
    git_commit, git_dirty   ATTNLAB_GIT_COMMIT / ATTNLAB_GIT_DIRTY (true/false) where set (whoever copied the tree
                            to a device machine says what it is), else HEAD of the checkout the script runs from
                            and whether a tracked file differs from it (untracked files not counted), else None
    device                  the GPU's name on CUDA, else the CPU's model ("CPU: ..."); None: CUDA if present
    nvidia_driver           nvidia-smi's driver_version, else /proc/driver/nvidia/version's; None without either
    torch, cuda             torch.__version__, torch.version.cuda (None on a CPU build)
    transformers, ctranslate2, python   installed versions (None when not installed)
    argv                    the command line as the script got it
    started_utc, ended_utc  ISO 8601 UTC: `started` (Unix time; default now) and now"""
    commit, dirty = git_state()
    return {"git_commit": commit, "git_dirty": dirty, "device": device_name(device),
            "nvidia_driver": nvidia_driver(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": installed("transformers"), "ctranslate2": installed("ctranslate2"),
            "python": platform.python_version(), "argv": [str(a) for a in argv],
            "started_utc": utc(started if started is not None else time.time()), "ended_utc": utc(time.time())}


def utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_state() -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout if r.returncode == 0 else None

    told = os.environ.get("ATTNLAB_GIT_COMMIT")
    commit = None if told else git("rev-parse", "HEAD")
    if commit is None:  # what whoever copied the tree says, if anything (a copy's .git may not be the tree's)
        dirty = os.environ.get("ATTNLAB_GIT_DIRTY", "").lower()
        return told or None, {"true": True, "false": False}.get(dirty)
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit.strip(), None if status is None else bool(status.strip())


def device_name(device: torch.device | str | None) -> str:
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                             else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    except OSError:
        model = None
    return f"CPU: {model.group(1).strip() if model else platform.processor() or platform.machine()}"


def nvidia_driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..."
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text(encoding="utf-8"))
    except OSError:
        return None
    return found.group(1) if found else None


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
