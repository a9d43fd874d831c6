"""Decoding throughput of attnlab against Hugging Face `generate`, in one process, fixed lengths with EOS off.

    python bench/decode_throughput.py                     # CUDA: issue 7's shapes, bf16 weights
    python bench/decode_throughput.py --cpu               # small shapes on the CPU (fp32): runs anywhere
    python bench/decode_throughput.py --only lm/ --json $OUT/decode.json

Translation (Transformer-base shape, random weights; batch 64, source 64, exactly 64 new tokens each):
  attnlab greedy_search / beam_search(beam 4) with min_len = max length (EOS held back), growing or static cache,
  or graph=True (every row kept, the decoder step one CUDA graph; on a CPU run eagerly), against
  MarianMTModel.generate(num_beams 1 or 4, min_new_tokens = max_new_tokens = 64). Reported in
  sentences/s. (attnlab's beam search makes one more decoder call than HF's: the step that scores the forced EOS.)
LM (the ~110M Llama-shaped model of train_throughput.py; batch 16, prompt 128, exactly 256 new tokens, greedy):
  attnlab generate with cache dynamic | static | graph (a CUDA graph per step; + compile_step), against
  LlamaForCausalLM.generate (its default cache, and cache_implementation="static"). Reported in new tokens/s.
Every call's output is checked to hold exactly the fixed number of new tokens. On CUDA every model is cast to
bf16; peak memory is torch.cuda.max_memory_allocated from building the model to the last call. Times are the
mean of --repeats calls after --warmup calls (which include compiling and CUDA-graph capture of the first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Env,
    add_common_args,
    make_env,
    need,
    peak_memory_gib,
    print_table,
    reset_memory,
    run_row,
    selected,
    time_steps,
    write_json,
)
from train_throughput import SHAPES as TRAIN_SHAPES  # noqa: E402
from train_throughput import Llama, Marian, encdec_config, lm_config  # noqa: E402

from attnlab.decode import beam_search, generate, greedy_search  # noqa: E402
from attnlab.models.transformer import build_model  # noqa: E402

SHAPES = {
    "full": {"mt": dict(batch=64, src=64, new=64), "lm": dict(batch=16, prompt=128, new=256)},
    "small": {"mt": dict(batch=4, src=16, new=16), "lm": dict(batch=2, prompt=16, new=32)},
}


def models(env: Env, task: str):
    """The attnlab model's config at the training benchmark's shape, with room for the decoded lengths."""
    size = "small" if env.small else "full"
    s = SHAPES[size][task]
    if task == "mt":
        shape = dict(TRAIN_SHAPES[size]["encdec"], src=s["src"], tgt=s["new"] + 1)
        return encdec_config(shape).replace(dropout=0.0), s
    shape = dict(TRAIN_SHAPES[size]["lm"], seq=s["prompt"] + s["new"])
    return lm_config(shape), s


def place(model: torch.nn.Module, env: Env) -> torch.nn.Module:
    model = model.to(env.device).eval()
    return model.to(torch.bfloat16) if env.cuda else model


def check(lengths: list[int], want: int, what: str) -> None:
    if any(n != want for n in lengths):
        raise AssertionError(f"{what} produced {sorted(set(lengths))} new tokens per row, not exactly {want}")


def measure(env: Env, task: str, name: str, args: argparse.Namespace) -> dict:
    cfg, s = models(env, task)
    reset_memory(env.device)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = s["new"]
    if task == "mt":
        src = torch.randint(3, cfg.vocab_size, (s["batch"], s["src"]), generator=g).to(env.device)  # (B, S)
        beam = 4 if "beam" in name else 1
        if name.startswith("attnlab"):
            model = place(build_model(cfg), env)
            kw = {"static_cache": name.endswith("static"), "graph": name.endswith("graph")}

            def call():
                if beam == 1:
                    out = greedy_search(model, src, max_len_a=0, max_len_b=n, min_len=n, **kw)
                else:
                    out = [h[0][0] for h in beam_search(model, src, beam_size=beam, max_len_a=0, max_len_b=n,
                                                        min_len=n, **kw)]
                check([len(o) for o in out], n, name)
        else:
            model = place(Marian(cfg).net, env)
            mask = torch.ones_like(src)

            def call():
                out = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     num_beams=beam, do_sample=False)  # (B, 1 + n): the start token first
                check([out.shape[1] - 1], n, name)
        unit, count = "sentences_per_s", s["batch"]
    else:
        prompt = torch.randint(3, cfg.vocab_size, (s["batch"], s["prompt"]), generator=g).to(env.device)  # (B, P)
        if name.startswith("attnlab"):
            model = place(build_model(cfg), env)
            cache = {"attnlab": "dynamic", "attnlab-static": "static"}.get(name, "graph")
            compiled = name == "attnlab-graph-compiled"
            if compiled:
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)

            def call():
                out = generate(model, prompt, n, greedy=True, cache=cache, compile_step=compiled)
                check([len(o) - s["prompt"] for o in out], n, name)
        else:
            need("transformers", "pip install transformers")
            model = place(Llama(cfg).net, env)
            mask = torch.ones_like(prompt)
            extra = {"cache_implementation": "static"} if name == "llama-static" else {}

            def call():
                out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, **extra)  # (B, P + n)
                check([out.shape[1] - s["prompt"]], n, name)
        unit, count = "tokens_per_s", s["batch"] * n
    warm, per_call = time_steps(call, args.warmup, args.repeats, env.device)
    return {unit: count / per_call, "s_per_call": per_call, "peak_mem_GiB": peak_memory_gib(env.device),
            "warmup_s": warm}


ROWS = {
    "mt": ["attnlab-greedy", "attnlab-greedy-static", "attnlab-greedy-graph", "marian-greedy", "attnlab-beam4",
           "attnlab-beam4-static", "attnlab-beam4-graph", "marian-beam4"],
    "lm": ["attnlab", "attnlab-static", "attnlab-graph", "attnlab-graph-compiled", "llama", "llama-static"],
}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--tasks", default="mt,lm")
    p.add_argument("--repeats", type=int, default=3, help="timed calls (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (compiling, graph capture)")
    p.add_argument("--compile-on-cpu", action="store_true", help="also run the compiled rows on a CPU (slow)")
    args = p.parse_args(argv)
    env = make_env(args)
    print(env.describe(), flush=True)
    rows: list[dict] = []
    for task in args.tasks.split(","):
        for name in ROWS[task]:
            compiled = name.endswith("compiled") or name == "llama-static"  # HF compiles its static-cache step
            if compiled and not (env.cuda or args.compile_on_cpu):
                continue
            if selected(f"{task}/{name}", args.only):
                run_row(rows, {"task": task, "model": name}, lambda t=task, n=name: measure(env, t, n, args))
    print()
    print(env.describe())
    print_table(rows, [("task", "task"), ("model", "model"), ("sentences_per_s", "sentences/s"),
                       ("tokens_per_s", "new tokens/s"), ("s_per_call", "s per call"),
                       ("peak_mem_GiB", "peak mem (GiB)"), ("warmup_s", "warm-up s"), ("status", "status")])
    write_json(args.json, env, rows, sys.argv)
    return rows


if __name__ == "__main__":
    main()
