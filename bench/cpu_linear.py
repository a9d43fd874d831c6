"""torch's F.linear against oneDNN's prepacked linear (attnlab.models.prepack) at a CPU decoding step's shapes.

    python bench/cpu_linear.py --threads 1 --json bench/results/cpu_linear_<date>.json

Each row: one (M, K, N) GEMM with bias, M the batch rows of a decoding step (sentences x beams), K x N a projection
of the demo model (d 128, FFN 512, vocabulary 4,000) or of the base model (d 512, vocabulary 37,000); the median of
--iters calls after a warm-up, in microseconds and GFLOP/s, for `F.linear` (the BLAS torch was built with) and for
`torch.ops.mkldnn._linear_pointwise` on the weight reordered once, and the largest difference between the two.
`attnlab.models.prepack.MIN_MACS` (M * K * N below which a search keeps F.linear) is read off these rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, run_row, write_record  # noqa: E402

SHAPES = [(1, 128, 128), (1, 128, 384), (1, 128, 4000), (8, 128, 128), (8, 128, 512), (16, 128, 384), (16, 128, 512),
          (23, 128, 384), (23, 128, 4000), (128, 128, 128), (128, 128, 384), (128, 512, 128), (128, 128, 4000),
          (512, 128, 4000), (1, 512, 1536), (1, 512, 37000), (128, 512, 1536), (128, 512, 37000)]


def median_us(fn, iters: int) -> float:
    for _ in range(max(iters // 10, 3)):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(m: int, k: int, n: int, iters: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)

    def plain():
        return F.linear(x, w, b)

    def onednn():
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    t_plain, t_packed = median_us(plain, iters), median_us(onednn, iters)
    flops = 2 * m * k * n
    return {"plain_us": t_plain, "packed_us": t_packed, "plain_gflops": flops / t_plain / 1e3,
            "packed_gflops": flops / t_packed / 1e3, "speedup": t_plain / t_packed,
            "max_abs_diff": (plain() - onednn()).abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--shapes", default="", help="M,K,N;M,K,N... (default: the decoding shapes above)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    rows: list[dict] = []
    with torch.no_grad():
        for m, k, n in shapes:
            run_row(rows, {"M": m, "K": k, "N": n, "threads": args.threads},
                    lambda m=m, k=k, n=n: measure(m, k, n, args.iters))
    print_table(rows, [("M", "M"), ("K", "K"), ("N", "N"), ("plain_gflops", "F.linear GFLOP/s"),
                       ("packed_gflops", "oneDNN packed GFLOP/s"), ("speedup", "speed-up"),
                       ("max_abs_diff", "max |diff|"), ("status", "status")])
    if args.json:
        write_record(args.json, {"command": "python bench/cpu_linear.py " + " ".join(argv), "rows": rows},
                     ["bench/cpu_linear.py", *argv], "cpu", started)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
