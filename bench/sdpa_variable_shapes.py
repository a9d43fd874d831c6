"""Training steps on batches of changing shape, with SDPA's cuDNN kernel allowed and without (CUDA only).

    python bench/sdpa_variable_shapes.py OUT.json      # the figures, with their provenance (bench/harness.py)

For the demo and the base recipe's model (an 8k vocabulary), 12 bf16 training steps, each on a new (batch, source,
target) shape of about 4,096 slots with a third of the sources padded, as token-count batches come; then the fixed
shape of bench/train_throughput.py (encdec/attnlab, lm/attnlab, eager) both ways. cuDNN builds an execution plan
for each new shape: the reason attnlab's attention leaves it out on a GPU (SDPA_GPU_BACKENDS in attention.py).
"""

import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput  # noqa: E402
from harness import write_record  # noqa: E402

from attnlab.experiment import load_experiment  # noqa: E402
from attnlab.lit.loss import token_loss  # noqa: E402
from attnlab.models import attention  # noqa: E402
from attnlab.models.transformer import build_model  # noqa: E402

ORDERS = {"cudnn_on": [SDPBackend.CUDNN_ATTENTION, *attention.SDPA_GPU_BACKENDS],
          "cudnn_off": list(attention.SDPA_GPU_BACKENDS)}


def step_times(cfg, steps: int = 12) -> list[float]:
    torch.manual_seed(0)
    model = build_model(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        S = int(torch.randint(8, 80, (1,), generator=g))
        T = S + int(torch.randint(-4, 5, (1,), generator=g))
        B = max(1, 4096 // max(S, T))
        src = torch.randint(4, cfg.vocab_size, (B, S), device="cuda")  # (B, S)
        tgt = torch.randint(4, cfg.vocab_size, (B, T + 1), device="cuda")  # (B, T+1)
        src[: B // 3, S // 2:] = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1])  # (B, T, V)
        token_loss(logits, tgt[:, 1:], 0, 0.1)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> None:
    command = sys.argv if argv is None else argv  # what provenance records
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python bench/sdpa_variable_shapes.py OUT.json")
    started = time.time()
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_variable_shapes.py: needs a CUDA device (SDPA's cuDNN kernel runs only there)")
    out = {}
    for recipe in ("experiments/demo_en_de.yaml", "experiments/wmt14_en_de_base.yaml"):
        cfg = load_experiment(recipe).model.replace(vocab_size=8000)
        for name, order in ORDERS.items():
            attention.SDPA_GPU_BACKENDS = order
            t = step_times(cfg)
            key = f"{Path(recipe).name}:{name}"
            out[key] = {"first5_ms": [round(1e3 * x, 1) for x in t[:5]], "median_ms": round(1e3 * sorted(t)[6], 1),
                        "total_s": round(sum(t), 2)}
            print(key, out[key], flush=True)
    for name, order in ORDERS.items():
        attention.SDPA_GPU_BACKENDS = order
        rows = train_throughput.main(["--modes", "eager", "--only", "encdec/attnlab,lm/attnlab"])
        out[f"bench:{name}"] = [(r["task"], r.get("tokens_per_s"), r.get("peak_mem_GiB")) for r in rows]
    write_record(Path(argv[0]), out, command, "cuda", started)


if __name__ == "__main__":
    main()
