"""torch's F.linear against oneDNN's prepacked linear (attnlab.models.prepack) at a CPU decoding step's shapes.

    python bench/cpu_linear.py --threads 1 --json bench/results/cpu_linear_<date>.json

Each row: one (M, K, N) GEMM with bias, M the batch rows of a decoding step (sentences x beams), K x N a projection
of the demo model (d 128, FFN 512, vocabulary 4,000) or of the base model (d 512, vocabulary 37,000); the median of
--iters calls after a warm-up, in microseconds and GFLOP/s, for `F.linear` (the BLAS torch was built with) and for
`torch.ops.mkldnn._linear_pointwise` on the weight reordered once, and the largest difference between the two.
`attnlab.models.prepack.MIN_MACS` (M * K * N below which a search keeps F.linear) is read off these rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import kernel_bench, median_us  # noqa: E402

SHAPES = [(1, 128, 128), (1, 128, 384), (1, 128, 4000), (8, 128, 128), (8, 128, 512), (16, 128, 384), (16, 128, 512),
          (23, 128, 384), (23, 128, 4000), (128, 128, 128), (128, 128, 384), (128, 512, 128), (128, 128, 4000),
          (512, 128, 4000), (1, 512, 1536), (1, 512, 37000), (128, 512, 1536), (128, 512, 37000)]


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
    return kernel_bench(argv, "cpu_linear.py", __doc__, ("M", "K", "N"), SHAPES, measure,
                        [("M", "M"), ("K", "K"), ("N", "N"), ("plain_gflops", "F.linear GFLOP/s"),
                         ("packed_gflops", "oneDNN packed GFLOP/s"), ("speedup", "speed-up"),
                         ("max_abs_diff", "max |diff|")], 200)


if __name__ == "__main__":
    raise SystemExit(main())
