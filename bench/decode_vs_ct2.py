"""attnlab's decoding against CTranslate2 on a trained translation checkpoint, each engine alone in its own process.

    python bench/decode_vs_ct2.py --ckpt runs/demo_en_de/checkpoints/last.ckpt --threads 1,2 \\
        --json bench/results/decode_vs_ct2_cpu_<date>.json
    python bench/decode_vs_ct2.py --ckpt ... --device cuda --json $OUT/decode_ct2.json

Both decode the sentences of the recipe's test split (or the first --limit), greedy (beam 1) and beam 4, each with
the recipe's maximum length a * source + b and fairseq's length penalty len^alpha with the recipe's alpha (the one
CTranslate2 implements), fp32 (float32 compute in CTranslate2). At each thread count N (a CPU; one run on CUDA),
three processes, one after the other, each alone on the machine:

    attnlab                     `translate_lines`, what `attnlab test` and `translate` run: N batches at once, each
                                on one thread (`--workers`), in its own batches (on a CPU by tokens:
                                evaluate.batch_sizes; `--config-batches` adds rows in the decode config's,
                                `--more-batches` in batches of other sentence counts); on CUDA also with
                                decode.cuda_graph
    ctranslate2                 CTranslate2 as its users set it up: `Translator(inter_threads=N, intra_threads=1)`,
                                one `translate_batch` of every sentence in batches of --ct2-tokens tokens
                                (`max_batch_size`, `batch_type="tokens"`), its one maximum length the largest of the
                                sentences' (each output then cut at its own); beside it with CTranslate2's default
                                maximum, 256 (a sentence that never ends stops there, not at its own maximum)
    attnlab --engine ctranslate2  `translate_lines(engine="ctranslate2")`: the checkpoint converted once into
                                <run dir>/ct2/, each sentence's own maximum length kept (export_ct2.ct2_translate)

Each row: sentences/s of the mean of --repeats passes after warm-up passes (one, and more for --warmup seconds;
and of the fastest pass; with --rounds R, the engines run in turn R times, each time each alone in a new process, and
the row counts every round's passes), the share of sentences whose text is attnlab's own (attnlab's row at the
first thread count, same beam), the test BLEU, what ran (`config`), the load average before and after, the share of
the CPUs other processes took meanwhile (`--wait-idle` waits for idle CPUs first) and the share the hypervisor gave
to other guests (`steal_share`). `--in-process` runs the rows in this process instead (for the tests: the timings
then share a process). `--int8` (CPU) adds int8 rows, apart from the fp32 comparison: attnlab with torch's dynamic
quantization of its linear layers, the engine with CTranslate2's int8 compute.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Env, need, print_table, run_row, write_json  # noqa: E402

from attnlab import evaluate  # noqa: E402
from attnlab.decode import position_cap  # noqa: E402
from attnlab.evaluate import load_module, load_tokenizer, run_dir_of, translate_lines  # noqa: E402
from attnlab.experiment import load_experiment  # noqa: E402
from attnlab.export_ct2 import converted, vocabulary  # noqa: E402
from attnlab.train import prepare  # noqa: E402

ENGINES = ("attnlab", "ctranslate2", "attnlab --engine ctranslate2")


def timed(fn, repeats: int, warmup: float = 0.0) -> tuple[list[float], object]:
    """Seconds of each of `repeats` passes after warm-up passes (one, and more until `warmup` seconds have gone),
    and the last pass's output."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < warmup:
        fn()
    seconds, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
    return seconds, out


def speed(seconds: list[float], n: int) -> dict:
    return {"sent_per_s": n / (sum(seconds) / len(seconds)), "sent_per_s_best": n / min(seconds),
            "seconds": [round(s, 4) for s in seconds]}


def cublas_files(device: str) -> dict:
    """On CUDA, the cuBLAS files mapped into this process (Linux): which one CTranslate2 ran on, where gpu_run.sh
    gave it CUDA 13's under CUDA 12's name."""
    if device != "cuda":
        return {}
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8")
    except OSError:
        return {}
    return {"cublas_files": sorted({line.split()[-1] for line in maps.splitlines() if "libcublas" in line})}


# ---------------------------------------------------------------------------------------------- one engine
def run_engine(spec: dict) -> list[dict]:
    """The rows of one engine at one thread count (`spec`, from `main`), each with its texts."""
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    workers = spec["threads"] or None
    n = len(spec["lines"])
    rows = []
    if spec["engine"] == "ctranslate2":  # no attnlab in the timed loop: CTranslate2's API as its users call it
        import ctranslate2

        ct2_cfg = dict(device=spec["device"], compute_type="float32", inter_threads=max(spec["threads"], 1),
                       intra_threads=1)
        translator = ctranslate2.Translator(spec["folder"], **ct2_cfg)
        for beam in spec["beams"]:
            # the largest of the sentences' maximum lengths (then none is cut before attnlab's), and CTranslate2's
            # default (256), which users who set none get
            for length, what in ((max(spec["limits"]), ""), (256, ", max_decoding_length 256")):
                kw = dict(beam_size=beam, length_penalty=spec["len_penalty"], max_batch_size=spec["ct2_tokens"],
                          batch_type="tokens", max_decoding_length=length)
                seconds, results = timed(lambda kw=kw: translator.translate_batch(spec["tokens"], **kw),
                                         spec["repeats"], spec["warmup"])
                hyps = [r.hypotheses[0][:limit] for r, limit in zip(results, spec["limits"], strict=True)]
                rows.append({"row": f"ctranslate2 beam {beam}{what}", "beam": beam, **speed(seconds, n),
                             "hyps": hyps, "config": {**ct2_cfg, **kw}, **cublas_files(spec["device"])})
        return rows
    module, tok = load_module(spec["ckpt"]), load_tokenizer(spec["ckpt"])
    cfg = module.decode_cfg.replace(penalty="fairseq")  # fairseq's length penalty: the one both implement
    device = torch.device(spec["device"])
    engine = "ctranslate2" if spec["engine"] != "attnlab" else "attnlab"
    for beam in spec["beams"]:
        # translate_lines' own batches (evaluate.batch_sizes) unless --batch-sentences / --max-tokens; with
        # --config-batches also the decode config's as they are, which a CPU's own do not use
        given = (spec["decode"].get("batch_sentences"), spec["decode"].get("max_tokens"))
        own = evaluate.batch_sizes(cfg, device, beam, *given)
        sizes = [(own, "")]
        if spec["config_batches"] and engine == "attnlab" and own != (cfg.batch_sentences, cfg.max_tokens):
            sizes.append(((cfg.batch_sentences, cfg.max_tokens), ", the decode config's batches"))
        if engine == "attnlab":  # --more-batches: batches of other sentence counts, as many tokens as its own
            sizes += [((n, own[1]), f", batches of {n} sentences") for n in spec["more_batches"] if n != own[0]]
        for graph in (False, True) if spec["device"] == "cuda" and engine == "attnlab" else (False,):
            for (bs, tokens), what in sizes:
                module.decode_cfg = cfg.replace(cuda_graph=graph)
                seconds, out = timed(lambda beam=beam, bs=bs, tokens=tokens: translate_lines(
                    module, tok, spec["lines"], beam=beam, device=device, engine=engine, ckpt_path=spec["ckpt"],
                    workers=workers, batch_sentences=bs, max_tokens=tokens), spec["repeats"], spec["warmup"])
                name = spec["engine"] + (", " if engine != "attnlab" else " ") + f"beam {beam}"
                batches = {"batch_sentences": bs, "max_tokens": tokens} if engine == "attnlab" else {}
                rows.append({"row": name + (", decode.cuda_graph" if graph else "") + what, "beam": beam,
                             **speed(seconds, n), "texts": out,
                             "config": {**module.decode_cfg.to_dict(), "engine": engine, **batches,
                                        "workers": workers, "torch_threads": torch.get_num_threads()},
                             **(cublas_files(spec["device"]) if engine != "attnlab" else {})})
        if spec["int8"]:
            rows.append(int8_row(module, tok, spec, beam, engine, workers))
    return rows


def int8_row(module, tok, spec: dict, beam: int, engine: str, workers: int | None) -> dict:
    """attnlab with torch's dynamic int8 quantization of its nn.Linear layers, or the engine with CTranslate2's int8
    compute."""
    import warnings

    from torch import nn

    import attnlab.export_ct2 as export_ct2

    fp32, real = module.model, export_ct2.compute_type
    with warnings.catch_warnings():  # torch deprecates its quantized tensors in favour of torchao
        warnings.simplefilter("ignore")
        if engine == "attnlab":
            module.model = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {nn.Linear}, dtype=torch.qint8)
        else:
            export_ct2.compute_type = lambda dtype: "int8"
        try:
            seconds, out = timed(lambda: translate_lines(
                module, tok, spec["lines"], beam=beam, device="cpu", engine=engine, ckpt_path=spec["ckpt"],
                workers=workers, batch_sentences=spec["decode"].get("batch_sentences"),
                max_tokens=spec["decode"].get("max_tokens")), spec["repeats"], spec["warmup"])
        finally:
            module.model, export_ct2.compute_type = fp32, real
    what = "attnlab int8 (torch dynamic)" if engine == "attnlab" else "attnlab --engine ctranslate2 int8"
    return {"row": f"{what}, beam {beam}", "beam": beam, **speed(seconds, len(spec["lines"])), "texts": out,
            "int8": True}


def cpu_seconds() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process's finished children, stolen by the hypervisor) so far;
    None off Linux. Busy counts the stolen seconds too: a vCPU the host gave to another guest was not idle."""
    try:
        jiffies = [int(x) for x in Path("/proc/stat").read_text(encoding="utf-8").split("\n")[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    # user nice system idle iowait irq softirq steal: busy less idle and iowait
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / tick, children.ru_utime + children.ru_stime, jiffies[7] / tick


def wait_idle(seconds: float) -> float | None:
    """Wait (at most `seconds`) until the CPUs have been idle for 6 s, as other users of a shared machine allow;
    the idle share of the last 2 s (None off Linux)."""
    idle, quiet, end = None, 0, time.monotonic() + seconds
    while True:
        before = cpu_seconds()
        time.sleep(2)
        after = cpu_seconds()
        if before is None or after is None:
            return None
        idle = 1 - (after[0] - before[0]) / (2 * (os.cpu_count() or 1))
        quiet = quiet + 1 if idle >= 0.95 else 0
        if quiet >= 3 or time.monotonic() > end:
            return round(idle, 3)


def in_child(spec: dict, in_process: bool) -> tuple[list[dict], dict]:
    """run_engine(spec) in a new Python process (or in this one), and what else ran meanwhile: the CPU seconds the
    machine's other processes took during the child's run, as a share of its CPUs (`others_cpu_share`), and the CPU
    time the hypervisor gave to other guests meanwhile (`steal_share`: on a shared VM it comes when the guest's CPUs
    are busy, which no wait for idle CPUs beforehand foresees)."""
    if in_process:
        threads = torch.get_num_threads()
        try:
            return run_engine(spec), {}
        finally:
            torch.set_num_threads(threads)
    t0, before = time.perf_counter(), cpu_seconds()
    # a new interpreter (spawned, not forked: nothing of this process's torch state), joined before the CPU count
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = pool.submit(run_engine, spec).result()
    wall, after = time.perf_counter() - t0, cpu_seconds()
    return rows, ({} if before is None or after is None else shares(before, after, wall, os.cpu_count() or 1))


def shares(before: tuple[float, float, float], after: tuple[float, float, float], wall: float, cpus: int) -> dict:
    """What the machine's other processes (busy seconds less this process's children's and less the stolen) and the
    hypervisor (stolen seconds) took of `cpus` CPUs over `wall` seconds, from two `cpu_seconds` readings."""
    busy, ours, stolen = (a - b for a, b in zip(after, before, strict=True))
    return {"others_cpu_share": round(max(busy - ours - stolen, 0.0) / (wall * cpus), 3),
            "steal_share": round(stolen / (wall * cpus), 3)}


def merge_rounds(rounds: list[tuple[list[dict], dict]], n: int) -> tuple[list[dict], dict]:
    """One engine's rows over its rounds (`--rounds`): the first round's rows (texts included), each with the passes
    of every round (`seconds`; sentences/s of their mean and of the fastest) and each round's sentences/s
    (`round_sent_per_s`), or the first failure; the loads of the first round before and the last after, the least
    idle share before a round and the most CPU the others took in one."""
    first, loads = rounds[0]
    if len(rounds) == 1:
        return first, loads
    rows = []
    for i, r in enumerate(first):
        same = [got[i] if i < len(got) and got[i]["row"] == r["row"] else {"row": r["row"], "error": "missing"}
                for got, _ in rounds]
        failed = next((x for x in same if "error" in x), None)
        if failed is not None:
            rows.append({"row": r["row"], "error": failed["error"]})
            continue
        seconds = [sec for x in same for sec in x["seconds"]]
        rows.append({**r, **speed(seconds, n), "round_sent_per_s": [round(speed(x["seconds"], n)["sent_per_s"], 1)
                                                                    for x in same]})
    merged = {"load_before": loads["load_before"], "load_after": rounds[-1][1]["load_after"], "rounds": len(rounds)}
    for key, pick in (("idle_before", min), ("others_cpu_share", max), ("steal_share", max)):
        if all(key in x for _, x in rounds):
            merged[key] = pick(x[key] for _, x in rounds)
    return rows, merged


# ---------------------------------------------------------------------------------------------- the table
def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="a translation checkpoint whose variant exports (Marian's)")
    p.add_argument("--threads", default="1,2", help="CPU thread counts, comma-separated")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--beams", default="1,4")
    p.add_argument("--limit", type=int, default=0, help="at most this many test sentences (0: all)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=float, default=0.0,
                   help="before each row's timed passes, warm-up passes for at least this many seconds (one at least): "
                        "on the 2-core VM a new process decoded its first seconds 20-40%% slower")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="source tokens a batch for attnlab and its engine (default: translate_lines' own)")
    p.add_argument("--batch-sentences", type=int, default=None,
                   help="sentences a batch for attnlab (default: translate_lines' own)")
    p.add_argument("--config-batches", action="store_true",
                   help="also attnlab rows in the run's decode config's batches, where its own differ (a CPU's)")
    p.add_argument("--more-batches", default="",
                   help="also attnlab rows in batches of these sentence counts, comma-separated (e.g. 256,1024 on "
                        "CUDA, where its own are the decode config's)")
    p.add_argument("--ct2-tokens", type=int, default=4096, help="the ctranslate2 row's max_batch_size in tokens")
    p.add_argument("--engines", default=",".join(ENGINES), help="rows to run, comma-separated, of: " +
                   ", ".join(ENGINES))
    p.add_argument("--int8", action="store_true",
                   help="also int8 rows on a CPU: attnlab with torch's dynamic quantization of its nn.Linear layers "
                        "(the tied output projection stays fp32), and the engine with CTranslate2's int8 compute")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engines in turn this many times, each time each alone in a new process, and count "
                        "every round's passes: a machine whose speed drifts (a shared VM's) then weighs on every "
                        "engine alike, not on whichever ran in a slow minute")
    p.add_argument("--in-process", action="store_true", help="run the engines in this process (tests)")
    p.add_argument("--wait-idle", type=float, default=0,
                   help="on a shared machine, before each engine's process wait up to this many seconds for the CPUs "
                        "to be idle (Linux; each row then says what other processes took while it ran)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: needs at least 1")
    need("ctranslate2", "pip install 'attnlab[ctranslate2]'")
    sacrebleu = need("sacrebleu", "pip install sacrebleu")
    exp = load_experiment(run_dir_of(args.ckpt) / "config.yaml")
    srcs, refs = prepare(exp)[0].split_texts("test")
    srcs, refs = (srcs[: args.limit], refs[: args.limit]) if args.limit else (srcs, refs)
    module, tok = load_module(args.ckpt), load_tokenizer(args.ckpt)
    cfg = module.decode_cfg
    folder = converted(args.ckpt)  # the engine's folder, converted here once: no row pays for it
    vocab = vocabulary(folder)
    ids = [list(i)[: module.model_cfg.max_seq_len - 1] + [tok.eos_id] for i in tok.encode_batch(srcs)]  # as ours
    cap = position_cap(module.model_cfg)  # decode.max_lengths' rule and cap
    limits = [min(int(cfg.max_len_a * len(s) + cfg.max_len_b), cap if cap is not None else 1 << 30) for s in ids]
    index = {t: i for i, t in enumerate(vocab)}
    decode = {k: v for k, v in (("max_tokens", args.max_tokens), ("batch_sentences", args.batch_sentences))
              if v is not None}
    base = dict(ckpt=str(args.ckpt), folder=str(folder), device=args.device, lines=srcs, tokens=[
        [vocab[t] for t in s] for s in ids], limits=limits, len_penalty=cfg.len_penalty, ct2_tokens=args.ct2_tokens,
        beams=[int(b) for b in args.beams.split(",")], repeats=args.repeats, decode=decode,
        int8=args.int8 and args.device == "cpu", config_batches=args.config_batches, warmup=args.warmup,
        more_batches=[int(n) for n in args.more_batches.split(",") if n.strip()])
    threads = [int(t) for t in args.threads.split(",")] if args.device == "cpu" else [0]
    engines = [e.strip() for e in args.engines.split(",")]
    env = Env(torch.device(args.device), False, None, float("nan"))
    rows: list[dict] = []
    ours: dict[int, list[str]] = {}  # beam -> attnlab's text at the first thread count
    for n in threads:
        runs: dict[str, list[tuple[list[dict], dict]]] = {}  # engine -> (rows, loads) of each round
        for _ in range(args.rounds):  # the engines in turn, each alone in its own process, `rounds` times
            for engine in [e for e in ENGINES if e in engines]:
                idle = {"idle_before": wait_idle(args.wait_idle)} if args.wait_idle else {}
                load = os.getloadavg()[0]
                try:
                    got, others = in_child({**base, "engine": engine, "threads": n}, args.in_process)
                except Exception as e:  # a failed engine is a failed row: the others still run
                    got, others = [{"row": engine, "error": f"{type(e).__name__}: {e}"}], {}
                runs.setdefault(engine, []).append((got, {"load_before": load, "load_after": os.getloadavg()[0],
                                                          **idle, **others}))  # 1-minute loads
        for engine, rounds in runs.items():
            got, loads = merge_rounds(rounds, len(srcs))
            for r in got:
                texts = r.pop("texts", None)
                if "hyps" in r:
                    texts = tok.decode_batch([[index[t] for t in h] for h in r.pop("hyps")])
                if engine == "attnlab" and texts is not None and not r.get("int8"):
                    ours.setdefault(r["beam"], texts)

                def row(r=r, texts=texts, loads=loads) -> dict:
                    if "error" in r:
                        raise RuntimeError(r["error"])
                    mine = ours.get(r["beam"])
                    same = sum(a == b for a, b in zip(mine, texts, strict=True)) / len(texts) if mine else None
                    return {**r, "same_text": same, "bleu": round(sacrebleu.corpus_bleu(texts, [refs]).score, 2),
                            **loads}

                run_row(rows, {"row": r["row"], "threads": n or "-", "engine": engine, "sentences": len(srcs)}, row)
    print_table(rows, [("row", "row"), ("threads", "threads"), ("sentences", "sentences"), ("sent_per_s", "sent/s"),
                       ("sent_per_s_best", "best"), ("same_text", "same text"), ("bleu", "BLEU"),
                       ("load_before", "load"), ("others_cpu_share", "others' CPU"), ("steal_share", "stolen"),
                       ("status", "status")])
    write_json(args.json, env, rows, sys.argv if argv is None else argv)
    return rows


if __name__ == "__main__":
    main()
