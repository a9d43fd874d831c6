"""What the training and decoding benchmarks share: device and size choice, the matmul peak measured in the same
process, timing with device syncs, peak memory, peers that may be missing, and the result table.

Every benchmark row runs in its own try block: a peer whose package is missing is reported as skipped with
the reason, and any other failure as failed with its error, so one broken row never costs the others
(device time is scarce)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import platform
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
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env.describe(), "command": " ".join(argv), "rows": rows}, indent=1))
