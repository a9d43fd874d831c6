"""Data pipeline throughput: tokenise and index a synthetic parallel corpus, then reopen it from the cache.

    python bench/data_throughput.py                       # 250k and 1M pairs (the RESULTS.md numbers)
    python bench/data_throughput.py --pairs 20000         # a quick run

For each size, three phases run in separate processes so each peak RSS is its own:
  build   train the BPE tokenizer and write the memory-mapped token cache (cold: nothing cached)
  cached  a fresh process: find the cache, open the memmaps, build the train sampler (what a second run pays)
  epoch   a fresh process: like cached, then collate every training batch once (a full epoch of data loading)
Peak RSS is ru_maxrss; for the cache phases the anonymous part (RssAnon: Python objects, index arrays) is
shown too, since mapped token pages are file-backed page cache that the kernel can drop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import write_record


def make_corpus(prefix: Path, n: int, seed: int = 0) -> None:
    """n random-ish pairs: Zipf-distributed pseudo-words, 4-40 words a sentence, a word-by-word 'translation'
    with a different spelling and an occasional swap, written as line-aligned <prefix>.en / <prefix>.de."""
    rng = np.random.default_rng(seed)
    syl_en = ["ta", "ri", "on", "ex", "ma", "lo", "st", "er", "in", "co", "de", "pa", "um", "ve", "sh", "al"]
    syl_de = ["sch", "ei", "ung", "ge", "ke", "ber", "ch", "au", "ie", "en", "ver", "lich", "ß", "ü", "ä", "t"]
    V = 20_000
    shape = rng.integers(0, 16, (V, 4))
    nsyl = rng.integers(1, 5, V)
    en = ["".join(syl_en[s] for s in shape[w, :nsyl[w]]) for w in range(V)]
    de = ["".join(syl_de[s] for s in shape[w, :nsyl[w]]) for w in range(V)]
    with open(f"{prefix}.en", "w", encoding="utf-8") as fe, open(f"{prefix}.de", "w", encoding="utf-8") as fd:
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            lens = rng.integers(4, 41, m)
            words = (rng.zipf(1.3, int(lens.sum())) - 1) % V
            out_en, out_de, at = [], [], 0
            for k in lens:
                ids = words[at:at + k].tolist()
                at += k
                out_en.append(" ".join(en[i] for i in ids).capitalize() + ".")
                if k > 5:
                    ids[1], ids[2] = ids[2], ids[1]
                out_de.append(" ".join(de[i] for i in ids).capitalize() + ".")
            fe.write("\n".join(out_en) + "\n")
            fd.write("\n".join(out_de) + "\n")


def rss() -> dict[str, float]:
    """Peak RSS (MiB) and, from /proc, the current anonymous / file-backed resident sizes."""
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0].lower() + "_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def phase(name: str, prefix: Path, cache: Path, max_tokens: int) -> dict:
    from attnlab.data import DataConfig, TranslationDataModule

    cfg = DataConfig(corpus=str(prefix), data_dir=str(cache), vocab_size=16000, max_tokens=max_tokens)
    t0 = time.perf_counter()
    dm = TranslationDataModule(cfg, seed=1)
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    out: dict = {"phase": name, "seconds": time.perf_counter() - t0, "batches": len(loader)}
    if name == "build":
        out["cache_seconds"] = dm.manifest["seconds"]  # encode + write; the rest is BPE training and reading
        out["pairs_kept"] = sum(s["kept"] for s in dm.manifest["stats"].values())
    if name == "epoch":
        t1 = time.perf_counter()
        tokens = sum(b["ntokens"] for b in loader)
        out["epoch_seconds"] = time.perf_counter() - t1
        out["target_tokens"] = tokens
    return {**out, **rss()}


def run_size(n: int, root: Path, max_tokens: int) -> list[dict]:
    prefix, cache = root / f"corpus{n}", root / f"cache{n}"
    t0 = time.perf_counter()
    make_corpus(prefix, n)
    print(f"[{n:,} pairs] corpus written in {time.perf_counter() - t0:.1f}s "
          f"({(os.path.getsize(f'{prefix}.en') + os.path.getsize(f'{prefix}.de')) / 2**20:.0f} MiB)", flush=True)
    results = []
    for name in ("build", "cached", "epoch"):
        r = subprocess.run([sys.executable, __file__, "--phase", name, "--prefix", str(prefix), "--cache", str(cache),
                            "--max-tokens", str(max_tokens)], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"phase {name} failed:\n{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["pairs"] = n
        results.append(res)
        extra = ""
        if name == "build":
            extra = f"  {n / res['seconds']:,.0f} pairs/s overall, {n / res['cache_seconds']:,.0f} pairs/s encode+index"
        if name == "epoch":
            extra = f"  epoch of collation {res['epoch_seconds']:.1f}s ({n / res['epoch_seconds']:,.0f} pairs/s)"
        print(f"  {name:6s} {res['seconds']:7.1f}s  peak RSS {res['peak_rss_mib']:7.0f} MiB  "
              f"anon {res.get('rssanon_mib', 0):6.0f} MiB{extra}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    started = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=[250_000, 1_000_000], help="corpus sizes to run")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--workdir", default=None, help="where corpora and caches go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.prefix), Path(args.cache), args.max_tokens)))
        return
    import tokenizers
    import torch

    print(f"torch {torch.__version__}, tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        results = [r for n in args.pairs for r in run_size(n, Path(tmp), args.max_tokens)]
    if args.json:  # {"rows": [...], "provenance": {...}}
        write_record(Path(args.json), {"rows": results}, sys.argv if argv is None else argv, "cpu", started)


if __name__ == "__main__":
    main()
