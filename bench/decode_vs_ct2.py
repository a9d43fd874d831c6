"""attnlab's decoding against CTranslate2 on a trained translation checkpoint, side by side in one process.

    python bench/decode_vs_ct2.py --ckpt runs/demo_en_de/checkpoints/last.ckpt --threads 1,2
    python bench/decode_vs_ct2.py --ckpt ... --device cuda --json $OUT/decode_ct2.json

The checkpoint is exported with `attnlab export --format ctranslate2` (into a temporary folder), and both decode
the sentences of the recipe's test split (or --limit of them): attnlab through `translate_lines` (what `attnlab
test` and `translate` run), CTranslate2 through `Translator.translate_batch`, each with the recipe's beam and
maximum length and fairseq's length penalty len^alpha with the recipe's alpha (the one CTranslate2 implements;
CTranslate2's maximum length is one per batch: the largest of attnlab's a * source + b), fp32 on a CPU (float32
compute in CTranslate2), greedy (beam 1) and beam 4, at each thread count
(torch.set_num_threads; CTranslate2's intra_threads). Decode time only: sentences/s of the mean of --repeats
passes after one warm-up pass. The share of sentences where both give the same tokens is reported beside it.
Beside them, `--engine ctranslate2` as `attnlab test` / `translate` run it: the checkpoint converted once into
<run dir>/ct2/, the sentences sorted by length and batched as attnlab batches them, one maximum length per
sentence (the plain CTranslate2 row takes the sentences in their order, in batches of decode.batch_sentences).
Every row gives its test BLEU. On CUDA, attnlab also runs with decode.cuda_graph (each decoding step one CUDA
graph). `--int8` (CPU) adds int8 rows, reported apart from the fp32 comparison: attnlab
with torch's dynamic quantization of its linear layers, and the engine with CTranslate2's int8 compute.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Env, need, print_table, run_row, write_json  # noqa: E402

from attnlab.config import DecodeConfig  # noqa: E402
from attnlab.evaluate import load_module, load_tokenizer, run_dir_of, translate_lines  # noqa: E402
from attnlab.experiment import load_experiment  # noqa: E402
from attnlab.export_ct2 import export_ctranslate2  # noqa: E402
from attnlab.train import prepare  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return (time.perf_counter() - t0) / repeats, out


def same_text(mine: list[str], out: list[str]) -> float | None:
    """The share of sentences where `out` is attnlab fp32's text `mine` (None before attnlab's row ran)."""
    return sum(a == b for a, b in zip(mine, out, strict=True)) / len(out) if mine else None


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


def int8_rows(rows, module, tok, srcs, beams, n, device, args, ours, bleu) -> None:
    """attnlab with torch's dynamic int8 quantization of its nn.Linear layers (a copy of the model), and the engine
    with CTranslate2's int8 compute: speed, the share of attnlab fp32's text, BLEU."""
    import warnings

    from torch import nn

    import attnlab.export_ct2 as export_ct2

    with warnings.catch_warnings():  # torch deprecates its quantized tensors in favour of torchao
        warnings.simplefilter("ignore")
        # a copy of the model; the module's own (fp32) is swapped back after the rows (a shallow copy of the module
        # would share its submodule dict, and quantize the fp32 rows of the next thread count with it)
        fp32, int8 = module.model, torch.ao.quantization.quantize_dynamic(copy.deepcopy(module.model), {nn.Linear},
                                                                           dtype=torch.qint8)
        for beam in beams:
            def q_row(beam=beam) -> dict:
                module.model = int8
                try:
                    seconds, out = timed(lambda: translate_lines(module, tok, srcs, beam=beam, device=device),
                                         args.repeats)
                finally:
                    module.model = fp32
                return {"engine": "attnlab", "sent_per_s": len(srcs) / seconds,
                        "same_text": same_text(ours.get(beam, []), out), "bleu": bleu(out)}

            def e_row(beam=beam) -> dict:
                real = export_ct2.compute_type
                export_ct2.compute_type = lambda dtype: "int8"  # the engine's compute type, for this row only
                try:
                    seconds, out = timed(lambda: translate_lines(module, tok, srcs, beam=beam, device=device,
                                                                 engine="ctranslate2", ckpt_path=args.ckpt),
                                         args.repeats)
                finally:
                    export_ct2.compute_type = real
                return {"engine": "ctranslate2", "sent_per_s": len(srcs) / seconds,
                        "same_text": same_text(ours.get(beam, []), out), "bleu": bleu(out)}

            base = {"threads": n, "beam": beam, "sentences": len(srcs)}
            run_row(rows, {**base, "row": f"attnlab int8 (torch dynamic), beam {beam}"}, q_row)
            run_row(rows, {**base, "row": f"attnlab --engine ctranslate2 int8, beam {beam}"}, e_row)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="a translation checkpoint whose variant exports (Marian's)")
    p.add_argument("--threads", default="1,2", help="CPU thread counts, comma-separated")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--beams", default="1,4")
    p.add_argument("--limit", type=int, default=0, help="at most this many test sentences (0: all)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=DecodeConfig.max_tokens,
                   help="decode.max_tokens for both (default: today's default, whatever the run's config says)")
    p.add_argument("--int8", action="store_true",
                   help="also int8 rows on a CPU: attnlab with torch's dynamic quantization of its nn.Linear layers "
                        "(the tied output projection stays fp32), and the engine with CTranslate2's int8 compute")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    ctranslate2 = need("ctranslate2", "pip install 'attnlab[ctranslate2]'")
    transformers = need("transformers", "pip install 'attnlab[hf]'")
    exp = load_experiment(run_dir_of(args.ckpt) / "config.yaml")
    srcs, refs = prepare(exp)[0].split_texts("test")
    srcs, refs = (srcs[: args.limit], refs[: args.limit]) if args.limit else (srcs, refs)
    sacrebleu = need("sacrebleu", "pip install sacrebleu")

    def bleu(hyps: list[str]) -> float:
        return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    module, tok = load_module(args.ckpt), load_tokenizer(args.ckpt)
    # fairseq's length penalty: the one both implement
    module.decode_cfg = module.decode_cfg.replace(penalty="fairseq", max_tokens=args.max_tokens)
    cfg = module.decode_cfg
    device = torch.device(args.device)
    env = Env(device, False, None, float("nan"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_ctranslate2(args.ckpt, Path(tmp) / "ct2")
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
        tokens = [hf_tok.convert_ids_to_tokens(hf_tok(s)["input_ids"]) for s in srcs]
        limits = [int(cfg.max_len_a * len(t) + cfg.max_len_b) for t in tokens]
        threads = [int(t) for t in args.threads.split(",")] if args.device == "cpu" else [0]
        beams = [int(b) for b in args.beams.split(",")]
        for n in threads:
            if n:
                torch.set_num_threads(n)
            # attnlab first at each thread count, CTranslate2 after: a live Translator's intra-op threads slow
            # torch's (measured: 2 torch threads 30% slower beside an idle 2-thread Translator; 5x after it ran)
            ours: dict[int, list[str]] = {}
            # on CUDA also with decode.cuda_graph (every step one CUDA graph); each row says which it ran, whatever
            # the checkpoint's recipe says
            for beam in beams:
                for graph in (False, True) if args.device == "cuda" else (False,):
                    def attnlab_row(beam=beam, graph=graph, ours=ours) -> dict:
                        module.decode_cfg = cfg.replace(cuda_graph=graph)
                        try:
                            seconds, out = timed(lambda: translate_lines(module, tok, srcs, beam=beam, device=device),
                                                 args.repeats)
                        finally:
                            module.decode_cfg = cfg
                        mine = {"same_text": same_text(ours.get(beam, []), out)} if graph else {}
                        ours.setdefault(beam, out)  # the default path's text, which the other rows compare with
                        return {"engine": "attnlab", "sent_per_s": len(srcs) / seconds, **mine, "bleu": bleu(out)}

                    run_row(rows, {"threads": n or "-", "beam": beam, "sentences": len(srcs),
                                   "row": f"attnlab beam {beam}" + (", decode.cuda_graph" if graph else "")},
                            attnlab_row)
            translator = ctranslate2.Translator(str(folder), device=args.device, compute_type="float32",
                                                intra_threads=n)
            for beam in beams:
                base = {"threads": n or "-", "beam": beam, "sentences": len(srcs)}
                mine = ours.get(beam, [])

                def ct2_row(beam=beam, mine=mine, translator=translator) -> dict:
                    def call():
                        return [r.hypotheses[0] for r in translator.translate_batch(
                            tokens, beam_size=beam, max_batch_size=cfg.batch_sentences,
                            length_penalty=cfg.len_penalty, max_decoding_length=max(limits))]
                    seconds, hyps = timed(call, args.repeats)
                    text = [hf_tok.decode(hf_tok.convert_tokens_to_ids(h), skip_special_tokens=True) for h in hyps]
                    return {"engine": "ctranslate2", "sent_per_s": len(srcs) / seconds,
                            "same_text": same_text(mine, text), "bleu": bleu(text), **cublas_files(args.device)}

                def engine_row(beam=beam, mine=mine) -> dict:  # what `--engine ctranslate2` runs
                    seconds, out = timed(lambda: translate_lines(module, tok, srcs, beam=beam, device=device,
                                                                 engine="ctranslate2", ckpt_path=args.ckpt),
                                         args.repeats)
                    return {"engine": "ctranslate2", "sent_per_s": len(srcs) / seconds,
                            "same_text": same_text(mine, out), "bleu": bleu(out), **cublas_files(args.device)}

                run_row(rows, {**base, "row": f"ctranslate2 beam {beam}"}, ct2_row)
                run_row(rows, {**base, "row": f"attnlab --engine ctranslate2, beam {beam}"}, engine_row)
            del translator, ct2_row  # the row's default argument holds it too
            if args.int8 and args.device == "cpu":
                int8_rows(rows, module, tok, srcs, beams, n, device, args, ours, bleu)
    print_table(rows, [("row", "row"), ("threads", "threads"), ("beam", "beam"), ("sentences", "sentences"),
                       ("sent_per_s", "sent/s"), ("same_text", "same text"), ("bleu", "BLEU"), ("status", "status")])
    write_json(args.json, env, rows, sys.argv if argv is None else argv)
    return rows


if __name__ == "__main__":
    main()
