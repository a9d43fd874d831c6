"""torch's argmax against attnlab.decode.row_argmax (the chunked one greedy decoding uses) on a CPU, at the logits
of a decoding step.

    python bench/cpu_argmax.py --threads 1 --json bench/results/cpu_argmax_<date>.json

Each row: (rows, vocabulary) logits drawn from N(0, 1), rows the sentences of a greedy step (the demo's token batches
of 2 to 409 sentences; 4,000 its vocabulary, 32,000 and 37,000 a base model's); the median of --iters calls after a
warm-up, in microseconds, of `logits.argmax(-1)`, of `row_argmax(logits)`, and of its chunks taken at any size
(ARGMAX_MIN_NUMEL set to 0), and whether the indices are the same. `ARGMAX_MIN_NUMEL` (the fewest logits
row_argmax chunks) is read off these rows: where the chunks start to beat torch's argmax.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import kernel_bench, median_us  # noqa: E402

from attnlab import decode  # noqa: E402
from attnlab.decode import row_argmax  # noqa: E402

SHAPES = [(2, 4000), (4, 4000), (8, 4000), (12, 4000), (16, 4000), (22, 4000), (64, 4000), (165, 4000), (409, 4000),
          (1, 32000), (2, 32000), (22, 32000), (128, 32000), (4, 37000), (128, 37000)]


def measure(n: int, v: int, iters: int) -> dict:
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0))  # (n, V)
    t_torch = median_us(lambda: logits.argmax(-1), iters)
    t_rows = median_us(lambda: row_argmax(logits), iters)
    threshold = decode.ARGMAX_MIN_NUMEL
    decode.ARGMAX_MIN_NUMEL = 0  # the chunks at every size, to show where they start to pay
    try:
        t_chunks = median_us(lambda: row_argmax(logits), iters)
        same = torch.equal(row_argmax(logits), logits.argmax(-1))
    finally:
        decode.ARGMAX_MIN_NUMEL = threshold
    return {"torch_us": t_torch, "row_argmax_us": t_rows, "chunked_us": t_chunks, "speedup": t_torch / t_rows,
            "same": bool(same and torch.equal(row_argmax(logits), logits.argmax(-1)))}


def main(argv: list[str] | None = None) -> int:
    return kernel_bench(argv, "cpu_argmax.py", __doc__, ("rows", "V"), SHAPES, measure,
                        [("rows", "rows"), ("V", "vocabulary"), ("torch_us", "argmax us"),
                         ("row_argmax_us", "row_argmax us"), ("chunked_us", "chunks at any size us"),
                         ("speedup", "speed-up"), ("same", "same indices")], 100)


if __name__ == "__main__":
    raise SystemExit(main())
