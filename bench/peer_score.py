"""The hand-written peer's test translations scored as attnlab scores its own, beside attnlab's on the same sentences.

    python bench/peer_score.py TEST_JSONL PEER_HYPS [--attnlab DEMO_RESULTS_JSON] [--log PEER_LOG] [--json OUT]

TEST_JSONL is the split both systems were tested on (attnlab's data cache, `{"src", "tgt"}` a line; the peer ran
with `--split-from` it, or a file of its first lines); PEER_HYPS the peer's `--hyp-out`, one hypothesis a line in
the test file's order. The scores are `attnlab.evaluate.score`'s (sacreBLEU with the target language's
tokenizer, chrF), with their signatures. With --attnlab (the `demo_results.json` of attnlab's run, whose
`translations` file holds each test sentence's hypothesis) it adds both systems' differences and a paired
bootstrap of them (sacreBLEU's `paired_bs`, 1,000 resamples of the test sentences): a like-for-like comparison on
one test set. With --log the peer's own steps and printed scores are copied from its log.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from harness import write_record

from attnlab.bleu import sacrebleu_bleu
from attnlab.evaluate import score


def read_split(path: Path) -> tuple[list[str], list[str]]:
    srcs, refs = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
            srcs.append(rec["src"])
            refs.append(rec["tgt"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}:{i}: not a {{'src', 'tgt'}} JSON line ({e})") from None
    return srcs, refs


def peer_log(path: Path) -> dict:
    """The peer's step count and its own printed scores, from its log."""
    text = path.read_text(encoding="utf-8", errors="replace")
    out: dict = {}
    if m := re.search(r"steps=(\d+) train_min=([\d.]+)", text):
        out.update(peer_steps=int(m.group(1)), peer_train_minutes=float(m.group(2)))
    if m := re.search(r"params=([\d.]+)M", text):
        out["peer_params_M"] = float(m.group(1))
    if m := re.search(r"RESULT lang=\S+ d=\d+ L=\d+ sacreBLEU=([\d.]+) chrF=([\d.]+)", text):
        out.update(peer_own_bleu=float(m.group(1)), peer_own_chrf=float(m.group(2)))
    return out


def paired(refs: list[str], systems: dict[str, list[str]], tgt_lang: str) -> dict:
    """sacreBLEU's paired bootstrap of the second system against the first (the baseline), BLEU and chrF."""
    from sacrebleu.metrics import CHRF
    from sacrebleu.significance import PairedTest

    test = PairedTest(list(systems.items()), {"BLEU": sacrebleu_bleu(tgt_lang), "chrF": CHRF()}, [refs],
                      test_type="bs", n_samples=1000)
    _, results = test()
    name = list(systems)[1]
    out = {}
    for metric, res in results.items():
        if metric == "System":
            continue
        r = res[1]
        out[metric] = {"p_value": float(r.p_value), "mean": float(r.mean), "ci": float(r.ci),
                       "versus": list(systems)[0], "system": name}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("test_jsonl", type=Path)
    p.add_argument("peer_hyps", type=Path)
    p.add_argument("--attnlab", type=Path, help="attnlab demo's demo_results.json on the same split")
    p.add_argument("--log", type=Path, help="the peer's log (its steps and own scores)")
    p.add_argument("--tgt-lang", default="de")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    started = time.time()
    srcs, refs = read_split(args.test_jsonl)
    if not args.peer_hyps.is_file():
        raise SystemExit(f"{args.peer_hyps}: no peer hypotheses (did the peer run finish?)")
    hyps = args.peer_hyps.read_text(encoding="utf-8").split("\n")
    hyps = hyps[:-1] if hyps and hyps[-1] == "" else hyps
    if len(hyps) != len(refs):
        raise SystemExit(f"{args.peer_hyps}: {len(hyps)} hypotheses for the {len(refs)} sentences of {args.test_jsonl}")
    out: dict = {"test": str(args.test_jsonl), "peer": score(hyps, refs, args.tgt_lang)}
    if args.log and args.log.is_file():
        out.update(peer_log(args.log))
    if args.attnlab and args.attnlab.is_file():
        mine = json.loads(args.attnlab.read_text(encoding="utf-8"))
        rows = [json.loads(line) for line in Path(mine["translations"]).read_text(encoding="utf-8").splitlines()]
        if [r["source"] for r in rows[:len(srcs)]] != srcs:  # the peer's test file: attnlab's, or its first lines
            raise SystemExit(f"{mine['translations']}: attnlab's test sentences are not those of {args.test_jsonl}")
        ours = [r["hypothesis"] for r in rows[:len(srcs)]]
        out["sentences_compared"] = f"{len(srcs)} of attnlab's {len(rows)}"
        out["attnlab"] = score(ours, refs, args.tgt_lang)
        out["attnlab_minus_peer"] = {k: round(out["attnlab"][k] - out["peer"][k], 2) for k in ("bleu", "chrf")}
        out["paired_bootstrap"] = paired(refs, {"peer": hyps, "attnlab": ours}, args.tgt_lang)
    print(json.dumps({k: v for k, v in out.items() if k not in ("peer", "attnlab")}, indent=1))
    for name in ("attnlab", "peer"):
        if name in out:
            print(f"{name:8s} BLEU {out[name]['bleu']:6.2f}  chrF {out[name]['chrf']:6.2f}  "
                  f"on {out[name]['sentences']} sentences")
    if args.json:  # with its provenance: the machine the peer ran on (gpu_run.sh scores where the peer ran)
        write_record(args.json, out, [Path(__file__).name, *(sys.argv[1:] if argv is None else argv)], None, started)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
