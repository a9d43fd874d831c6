"""Attention over padded batches: which route keeps a fast kernel on a GPU.

    python bench/padded_attention.py --json OUT.json     # CUDA, bf16, the base model's heads
    python bench/padded_attention.py --dry-run           # toy sizes on a CPU, fp32: the routes agree (no timings kept)

A batch of B sequences whose lengths are drawn uniformly from [--min-len, --max-len] (the default 8-120 leaves
about half the slots padding: a batch of mixed sentence lengths; --min-len 56 --max-len 72 is one sorted by length),
H heads of hd dims. Each route runs the forward and backward of bidirectional attention with key padding (the
encoder's self-attention; cross-attention is the same kernel with other queries), from padded q, k, v
(B, H, S, hd) to a padded output, the route's packing and unpacking included:
  sdpa_mask    F.scaled_dot_product_attention with the bool key mask: attnlab's route today (the memory-efficient
               kernel on CUDA; flash takes no mask)
  sdpa_nomask  the same without a mask: the flash kernel over the padded shape. Not a correct route with padding
               (padded keys are attended); the bar the others are held to
  jagged       nested jagged tensors (torch.nested, layout jagged): SDPA over the real tokens only (flash on CUDA)
  flex         FlexAttention with a block mask of the key padding (torch.compile'd; the mask is made once a batch,
               timed apart: every layer of a forward shares it)
  varlen       flash-attn's flash_attn_varlen_func over the real tokens (where flash-attn is installed)
Each route's output at the real tokens, and its gradients, are checked against sdpa_mask's in fp32 first (`max_err`,
the route in the timed dtype). Timings: CUDA events, the median of --iters after --warmup, in ms, and real tokens
per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Env, Missing, print_table, run_row, write_json  # noqa: E402

Route = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Batch:
    """Lengths (B,), the key padding (B, S) True at padding, and the indices that pack and unpack real tokens."""

    def __init__(self, lengths: torch.Tensor, S: int, device: torch.device) -> None:
        self.lengths, self.B, self.S = lengths.to(device), len(lengths), S
        self.pad = torch.arange(S, device=device)[None, :] >= self.lengths[:, None]  # (B, S)
        self.keep = (~self.pad).flatten().nonzero().squeeze(1)  # (N,) rows of the flattened (B*S) tokens
        self.offsets = F.pad(self.lengths.cumsum(0), (1, 0))  # (B+1,)
        self.cu = self.offsets.to(torch.int32)  # (B+1,) flash-attn's cu_seqlens
        self.max_len = int(self.lengths.max())
        self.tokens = int(self.lengths.sum())

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, S, hd) -> (N, H, hd), the real tokens."""
        B, H, S, hd = x.shape
        return x.transpose(1, 2).reshape(B * S, H, hd).index_select(0, self.keep)  # (N, H, hd)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """(N, H, hd) -> (B, H, S, hd), zeros at padding."""
        N, H, hd = y.shape
        dense = y.new_zeros(self.B * self.S, H, hd).index_copy(0, self.keep, y)  # (B*S, H, hd)
        return dense.view(self.B, self.S, H, hd).transpose(1, 2)  # (B, H, S, hd)


def padding_block_mask(batch: Batch):
    """FlexAttention's block mask of the key padding: key j of sequence b is seen where j < its length."""
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = batch.lengths  # (B,)
    return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], batch.B, None, batch.S, batch.S,
                             device=str(batch.pad.device))


def routes(batch: Batch, compile_flex: bool) -> dict[str, Route | None]:
    """Each route: padded q, k, v (B, H, S, hd) -> padded output (B, H, S, hd). None where it cannot run here."""
    allowed = ~batch.pad[:, None, None, :]  # (B, 1, 1, S)

    def sdpa_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    def sdpa_nomask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def jagged(q, k, v):
        def nested(x):  # (B, H, S, hd) -> nested (B, H, j, hd)
            return torch.nested.nested_tensor_from_jagged(batch.pack(x), batch.offsets).transpose(1, 2)

        out = F.scaled_dot_product_attention(nested(q), nested(k), nested(v))  # nested (B, H, j, hd)
        return batch.unpack(out.transpose(1, 2).values())

    out: dict[str, Route | None] = {"sdpa_mask": sdpa_mask, "sdpa_nomask": sdpa_nomask, "jagged": jagged}
    from torch.nn.attention.flex_attention import flex_attention

    block = padding_block_mask(batch)
    flex_fn = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    out["flex"] = lambda q, k, v: flex_fn(q, k, v, block_mask=block)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        out["varlen"] = None
    else:
        def varlen(q, k, v):
            y = flash_attn_varlen_func(batch.pack(q), batch.pack(k), batch.pack(v), batch.cu, batch.cu,
                                       batch.max_len, batch.max_len)  # (N, H, hd)
            return batch.unpack(y)

        out["varlen"] = varlen if batch.pad.is_cuda else None
    return out


def check(route: Route, ref: Route, q, k, v, batch: Batch, grad: bool) -> float:
    """The largest difference from the reference at the real tokens, output and (with `grad`) gradients."""
    real = ~batch.pad[:, None, :, None]  # (B, 1, S, 1)
    errs = []
    outs, grads = [], []
    for fn, dtype in ((route, q.dtype), (ref, torch.float32)):  # the route in the timed dtype, the reference in fp32
        xs = [t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v)]
        y = fn(*xs)  # (B, H, S, hd)
        outs.append(y.masked_fill(~real, 0).float())
        if grad:
            (y.float() * real).square().sum().backward()
            grads.append([x.grad.masked_fill(~real, 0).float() for x in xs])
    errs.append(float((outs[0] - outs[1]).abs().max()))
    for a, b in zip(*grads, strict=True) if grad else ():
        errs.append(float((a - b).abs().max()))
    return max(errs)


def timed(route: Route, q, k, v, warmup: int, iters: int) -> float:
    """Median ms of forward + backward (CUDA events)."""
    xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    grad_out = torch.randn_like(q)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        route(*xs).backward(grad_out)
        end.record()
        if i >= warmup:
            end.synchronize()
            times.append(start.elapsed_time(end))
        for x in xs:
            x.grad = None
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=120)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU, fp32: agreement only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.batch, args.heads, args.head_dim, args.min_len, args.max_len = 6, 2, 16, 3, 17
    elif not torch.cuda.is_available():
        raise SystemExit("bench/padded_attention.py times CUDA kernels: no CUDA device here (use --dry-run)")
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)  # (B,)
    S = int(lengths.max())
    batch = Batch(lengths, S, device)
    q, k, v = (torch.randn(args.batch, args.heads, S, args.head_dim, generator=g).to(device, dtype)
               for _ in range(3))  # (B, H, S, hd)
    env = Env(device, False, None, float("nan"))
    found = routes(batch, compile_flex=not args.dry_run)
    ref32 = routes(batch, compile_flex=False)["sdpa_mask"]
    rows: list[dict] = []
    padding = round(1 - batch.tokens / (args.batch * S), 3)  # the share of the (B, S) slots that are padding
    base = {"batch": args.batch, "S": S, "tokens": batch.tokens, "padding": padding, "heads": args.heads,
            "head_dim": args.head_dim, "dtype": str(dtype).removeprefix("torch.")}
    for name, route in found.items():
        def row(name=name, route=route) -> dict:
            if route is None:
                raise Missing("flash-attn is not installed (or no CUDA)")
            # agreement with the masked reference in fp32 (flex has no backward on a CPU)
            err = None if name == "sdpa_nomask" else check(
                route, ref32, q, k, v, batch, grad=device.type == "cuda" or name != "flex")
            out = {"max_err": err}
            if device.type == "cuda":
                ms = timed(route, q, k, v, args.warmup, args.iters)
                out |= {"ms": round(ms, 3), "tokens_per_s": round(batch.tokens / ms * 1e3)}
            return out

        run_row(rows, {**base, "route": name}, row)
    if device.type == "cuda":
        def block_mask_row() -> dict:
            padding_block_mask(batch)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                padding_block_mask(batch)
            end.record()
            end.synchronize()
            return {"ms": round(start.elapsed_time(end) / 10, 3)}

        run_row(rows, {**base, "route": "flex block mask (once a batch)"}, block_mask_row)
    print_table(rows, [("route", "route"), ("padding", "padding"), ("tokens", "tokens"), ("ms", "ms"),
                             ("tokens_per_s", "tokens/s"), ("max_err", "max err"), ("status", "status")])
    write_json(args.json, env, rows, sys.argv if argv is None else argv)
    bad = [r["route"] for r in rows if r.get("max_err") is not None and r["max_err"] > (1e-4 if args.dry_run else 5e-2)]
    if bad:
        raise SystemExit(f"bench/padded_attention.py: routes disagree with sdpa_mask: {bad}")
    if args.dry_run and any(r["status"].startswith("failed") for r in rows):
        raise SystemExit("bench/padded_attention.py --dry-run: a route failed (above)")
    return rows


if __name__ == "__main__":
    main()
