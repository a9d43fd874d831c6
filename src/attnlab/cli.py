"""The `attnlab` command: fit, validate, test, demo, translate, generate, average, bleu, export, info, ablate.

Follows LightningCLI's conventions: `attnlab fit -c experiments/demo_en_de.yaml --model.norm rmsnorm
--trainer.max_steps 100`; several `-c` files merge in order; `--print-config` prints the resolved recipe;
`--ckpt-path last` resumes; `attnlab fit --help` lists every config field. Unknown or mistyped keys are errors
naming the key path (with the closest key), exit status 2.
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning  # imported before logging is set up: see quiet_third_party
import torch

from . import __version__
from .ablate.commands import add_ablate_commands, cmd_ablate
from .best_window import checkpoints_to_average
from .bleu import compound_split_bleu, read_pair, target_language
from .checkpoints import average_checkpoints, check_compatible, last_checkpoints, load_checkpoint
from .cliargs import Parser, check_options, config_help
from .config import ConfigError, ModelConfig
from .evaluate import (
    GENERATE_MAX_NEW_TOKENS,
    decode_dtype,
    generate_text,
    load_module,
    load_tokenizer,
    pick_device,
    recipe_precision,
    run_dir_of,
    score,
    translate_lines,
    write_translations,
)
from .experiment import known_type, load_experiment, parse_value
from .export import export_hf
from .export_ct2 import export_ctranslate2
from .files import DiskFull
from .info import info_config, published_comparison
from .launch.slurm import add_slurm_args, submit_fit
from .models.accounting import count_parameters, training_flops
from .train import fit, fit_rank, make_trainer, prepare


def parse_overrides(rest: list[str]) -> dict[str, Any]:
    """`--section.key value` or `--section.key=value` pairs; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --model.norm rmsnorm")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} needs a value (--{key} VALUE or --{key}=VALUE)")
            value, i = rest[i + 1], i + 1
        out[key] = parse_value(value, known_type(key))
        i += 1
    return out


# ---------------------------------------------------------------------------------------------- commands
def cmd_info(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.config_file is None):
        raise ConfigError("give one config: attnlab info FILE or attnlab info -c FILE")
    args.config = args.config or args.config_file
    cfg, vocab_from, recipe = info_config(args.config)
    counts = count_parameters(cfg)
    total = counts.pop("total")
    print(f"{args.config}: arch={cfg.arch} d_model={cfg.d_model} heads={cfg.n_heads}/{cfg.kv_heads} "
          f"d_k={cfg.d_k} d_v={cfg.d_v} "
          f"ffn={cfg.ffn}({cfg.ffn_dim}) norm={cfg.norm}/{cfg.norm_position}{'+embed_norm' * cfg.embed_norm} "
          f"block={cfg.block} position={cfg.position}")
    print(f"vocabulary: {vocab_from}; embeddings tied: {cfg.tie_embeddings}")
    width = max(len(k) for k in counts)
    for name, n in counts.items():
        if n:
            print(f"  {name:<{width}}  {n:>15,}  {100 * n / total:5.1f}%")
    print(f"  {'total':<{width}}  {total:>15,}  ({total / 1e6:.2f}M)")
    for line in published_comparison(cfg, total, recipe):
        print(line)
    src_len = args.src_len if cfg.arch == "encoder_decoder" else None
    flops = training_flops(cfg, args.seq_len, src_len)
    what = f"target token (source {src_len}, target {args.seq_len})" if src_len else f"token (length {args.seq_len})"
    print(f"training FLOPs per {what}: {flops['per_token']:.4g}  (6N + attention; see attnlab.models.accounting)")
    return 0


def cmd_fit(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    exp = load_experiment(args.config, overrides)
    if args.slurm:  # submit the same run as a SLURM job instead (attnlab.launch.slurm)
        return submit_fit(exp, args)
    if args.dry_run:  # what would run, without preparing data or training
        print(exp.to_yaml(), end="")
        print(f"# dry run: nothing trained. Run directory: {exp.run_dir()}; model.vocab_size (and src_vocab_size) "
              f"come from the tokenizer when fit runs.", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    run_dir = fit(exp, ckpt_path=args.ckpt_path)
    if fit_rank() != 0:
        return 0
    print(f"fit done in {time.perf_counter() - t0:.0f}s; run directory: {run_dir}")
    return 0


def cmd_eval(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """validate / test: loss and perplexity on the split; for translation also beam-search BLEU and chrF
    on the split's real text (sacreBLEU, with its signature)."""
    exp = load_experiment(args.config, overrides)
    dev = pick_device(args.device)
    if exp.task != "translation" and (args.beam or args.engine):  # they would be ignored
        raise ConfigError(f"--beam and --engine choose how translations are decoded; this recipe trains "
                          f"{exp.task}, which {args.command} scores by loss and perplexity alone")
    dm, exp = prepare(exp)
    ckpt = load_checkpoint(args.ckpt)
    check_compatible(ckpt, exp.model, args.ckpt)
    module = load_module(args.ckpt, exp.decode, ckpt=ckpt)
    split = "valid" if args.command == "validate" else "test"
    t0 = time.perf_counter()
    # one process on the chosen device, whatever the recipe trains with: under DDP the samplers would repeat
    # batches to even out the ranks' shares, and those would be counted twice
    on_dev = exp.replace(trainer=exp.trainer.replace(accelerator="gpu" if dev.type == "cuda" else "cpu"))
    trainer = make_trainer(on_dev, exp.run_dir(), logger=False, callbacks=[], enable_progress_bar=False,
                           devices=[dev.index or 0] if dev.type == "cuda" else 1, num_nodes=1, strategy="auto")
    if exp.task == "translation":
        module.decode_cfg = module.decode_cfg.__class__.from_dict({**exp.decode.to_dict(), "val_sentences": 0})
    run = trainer.validate if split == "valid" else trainer.test
    metrics = {k: float(v) for k, v in run(module, datamodule=dm, verbose=False)[0].items()}
    if exp.task == "translation":
        srcs, refs = dm.split_texts(split)
        hyps = translate_lines(module, dm.tokenizer, srcs, beam=args.beam or exp.decode.beam, device=dev,
                               dtype=decode_dtype(dev, exp.trainer.precision), engine=args.engine,
                               ckpt_path=args.ckpt)
        metrics.update(score(hyps, refs, exp.data.tgt_lang))
        metrics["examples"] = [{"source": s, "reference": r, "hypothesis": h}
                               for s, r, h in list(zip(srcs, refs, hyps, strict=True))[:5]]
    metrics["seconds"] = round(time.perf_counter() - t0, 1)
    out = run_dir_of(args.ckpt) / f"{split}_results.json"  # the run's folder, or the checkpoint's own
    if exp.task == "translation":
        metrics["translations"] = str(write_translations(out.parent / f"{split}_translations.jsonl", srcs, refs, hyps))
    out.write_text(json.dumps(metrics, indent=2, ensure_ascii=False), encoding="utf-8")
    print(json.dumps(metrics, indent=2, ensure_ascii=False))
    print(f"results in {out}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """The main job: fit, average the last checkpoints, decode the test split with beam search, score."""
    exp = load_experiment(args.config, overrides)
    if exp.task != "translation":
        raise ConfigError(f"{args.config}: attnlab demo runs a translation recipe (model.arch=encoder_decoder)")
    dev = pick_device(args.device)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    dm, resolved = prepare(exp)
    times["data (tokenizer + caches)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_dir = fit(exp)
    times["train"] = time.perf_counter() - t0
    if fit_rank() != 0:  # DDP's other ranks: averaging, decoding and the results are rank 0's
        return 0
    t0 = time.perf_counter()
    found, at, which = checkpoints_to_average(run_dir, exp.decode.average_last, exp.decode.average_at)
    paths = [str(p) for p in found]
    averaged = run_dir / "checkpoints" / f"averaged_{at}{len(paths)}.ckpt"
    avg = average_checkpoints(paths, str(averaged))
    times[f"average {len(paths)} checkpoints"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    module = load_module(averaged, resolved.decode, ckpt=avg)  # the averaged weights as written, not read back
    srcs, refs = dm.split_texts("test")
    hyps = translate_lines(module, dm.tokenizer, srcs, beam=exp.decode.beam, device=dev,
                           dtype=decode_dtype(dev, exp.trainer.precision), engine=args.engine, ckpt_path=averaged)
    result = score(hyps, refs, exp.data.tgt_lang)
    times[f"beam-{exp.decode.beam} decode + score ({len(srcs)} test sentences, {dev})"] = time.perf_counter() - t0
    result["phase_seconds"] = {k: round(v, 1) for k, v in times.items()}
    result["checkpoints_averaged"] = paths
    result["checkpoints_averaged_which"] = which
    result["translations"] = str(write_translations(run_dir / "demo_translations.jsonl", srcs, refs, hyps))
    (run_dir / "demo_results.json").write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
    print(f"\n{'=' * 78}\n{result['bleu_detail']}\nchrF2 = {result['chrf']:.2f}")
    print(f"BLEU signature: {result['bleu_signature']}\nchrF signature: {result['chrf_signature']}")
    print("\nexamples (source / reference / attnlab):")
    src_label, tgt_label = exp.data.src_lang.upper(), exp.data.tgt_lang.upper()
    width = max(len(src_label), len(tgt_label), 2)
    src_label, tgt_label = src_label.ljust(width), tgt_label.ljust(width)
    for s, r, h in list(zip(srcs, refs, hyps, strict=True))[:: max(1, len(srcs) // 5)][:5]:
        print(f"  {src_label}  {s}\n  {tgt_label}  {r}\n  {'MT':<{width}}  {h}\n")
    print("phases:")
    for k, v in times.items():
        print(f"  {k:<48} {v:7.1f} s")
    print(f"run directory: {run_dir}  (results in {run_dir / 'demo_results.json'})")
    return 0


def cmd_translate(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    ckpt = load_checkpoint(args.ckpt)
    module = load_module(args.ckpt, ckpt=ckpt)
    if not isinstance(module.model_cfg, ModelConfig) or module.model_cfg.arch != "encoder_decoder":
        raise ConfigError(f"{args.ckpt} is not a translation model (model.arch={module.model_cfg.arch})")
    tok = load_tokenizer(args.ckpt, ckpt)
    dev = pick_device(args.device)
    name = "<stdin>" if args.input == "-" else args.input
    data = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows editors write one) is not text
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{name}: line {line} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = text.split("\n")  # one translation per input line (as wc -l counts them), empty lines included
    if lines[-1] == "":
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    dtype = decode_dtype(dev, recipe_precision(args.ckpt))
    if args.threads and dev.type == "cpu":  # as many batches decoded at once, each on one thread (translate_lines)
        torch.set_num_threads(args.threads)
    for hyp in translate_lines(module, tok, lines, beam=args.beam, device=dev, dtype=dtype, engine=args.engine,
                               ckpt_path=args.ckpt):
        print(hyp.replace("\r", " ").replace("\n", " "))  # a decoded newline must not break the alignment
    return 0


def cmd_generate(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    ckpt = load_checkpoint(args.ckpt)
    module = load_module(args.ckpt, ckpt=ckpt)
    if module.model_cfg.arch != "decoder_only":
        raise ConfigError(f"{args.ckpt} is not a language model (model.arch={module.model_cfg.arch}); " + (
            "attnlab translate decodes translation models" if module.model_cfg.arch == "encoder_decoder" else
            "a masked language model is scored by attnlab validate / test"))
    tok = load_tokenizer(args.ckpt, ckpt)
    dev = pick_device(args.device)
    print(generate_text(module, tok, args.prompt, args.max_new_tokens, args.seed, dev,
                        decode_dtype(dev, recipe_precision(args.ckpt)), temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p))
    return 0


def cmd_average(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    if not args.ckpts and not args.run_dir:
        raise ConfigError("attnlab average needs --run_dir (its last --last checkpoints) or --ckpts a.ckpt b.ckpt ...")
    paths = args.ckpts or [str(p) for p in last_checkpoints(Path(args.run_dir) / "checkpoints", args.last)]
    if not paths:
        raise FileNotFoundError(f"no checkpoints to average in {args.run_dir}/checkpoints")
    out = args.out or str(Path(paths[-1]).parent / f"averaged_last{len(paths)}.ckpt")
    if Path(out).is_dir():
        raise IsADirectoryError(f"--out {out} is a folder: give the file to write ({Path(out) / 'averaged.ckpt'})")
    average_checkpoints(paths, out)
    print(f"averaged {len(paths)} checkpoints -> {out}")
    for p in paths:
        print(f"  {p}")
    return 0


def cmd_bleu(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """sacreBLEU and chrF of a hypothesis file against a reference file (detokenised text, one sentence a line);
    with --compound-split also the 2017 papers' tokenised BLEU with compound splitting (attnlab.bleu)."""
    hyps, refs = read_pair(args.hyp, args.ref)
    result: dict[str, Any] = score(hyps, refs, args.lang)
    print(f"sacreBLEU (detokenised): {result['bleu_detail']}\n  signature: {result['bleu_signature']}")
    print(f"chrF2: {result['chrf']:.2f}\n  signature: {result['chrf_signature']}")
    if args.compound_split:
        tok = compound_split_bleu(hyps, refs, lang=args.lang)
        result["compound_split"] = tok
        print(f"tokenised BLEU with compound splitting (as in Vaswani et al. 2017): {tok['detail']}")
        print(f"  method: {tok['method']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
    return 0


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--beam 0` is an error, not a silent fallback to the recipe's beam)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_device_arg(p: argparse.ArgumentParser, what: str = "decoding") -> None:
    p.add_argument("--device", default=None,
                   help=f"where {what} runs: cuda, cuda:N or cpu (default: cuda when available, else cpu); bf16 "
                        "autocast on CUDA where the recipe trains in bf16, fp32 on a CPU")


def add_engine_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("attnlab", "ctranslate2"), default=None,
                   help="what decodes (default: decode.engine): attnlab, or CTranslate2 on this checkpoint, converted "
                        "once into <run dir>/ct2/ (the ctranslate2 extra; what export --format ctranslate2 converts)")


def cmd_export(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """A checkpoint as a Hugging Face model folder (LlamaForCausalLM or MarianMTModel, attnlab.export) or a
    CTranslate2 one (attnlab.export_ct2)."""
    if args.format == "ctranslate2":
        out = export_ctranslate2(args.ckpt, args.out, args.quantization)
        print(f"exported {args.ckpt} -> {out}  (ctranslate2.Translator / ctranslate2.Generator; "
              "transformers.AutoTokenizer.from_pretrained for its tokens)")
        return 0
    if args.quantization:
        raise ConfigError("--quantization is for --format ctranslate2")
    out = export_hf(args.ckpt, args.out)
    print(f"exported {args.ckpt} -> {out}  (transformers: AutoModel*.from_pretrained / AutoTokenizer.from_pretrained)")
    return 0


def build_parser() -> Parser:
    p = Parser(prog="attnlab", description="Transformer research: train, evaluate, ablate. Options may be spelled "
               "with dashes or underscores (--ckpt-path, --ckpt_path).")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--version", action="version",
                   version=f"attnlab {__version__} (torch {torch.__version__}, lightning {lightning.__version__})")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter breakdown and training FLOPs of a config, without building it")
    info.add_argument("config", nargs="?", help="YAML: a model config, or an experiment recipe")
    info.add_argument("-c", "--config", dest="config_file", metavar="FILE", help="the same, as other commands take it")
    info.add_argument("--seq-len", type=positive_int, default=128, help="(target) sequence length for FLOPs")
    info.add_argument("--src-len", type=positive_int, default=128, help="source length for encoder-decoder FLOPs")
    recipe = {"epilog": config_help(), "formatter_class": argparse.RawDescriptionHelpFormatter}

    def add_config(q: argparse.ArgumentParser) -> None:
        q.add_argument("-c", "--config", action="append", required=True, metavar="FILE",
                       help="experiment recipe; several -c merge in order, later ones overriding earlier ones")
        q.add_argument("--print-config", action="store_true",
                       help="print the resolved recipe (files, base: chain and overrides merged) as YAML and exit")

    fit_p = sub.add_parser("fit", help="train an experiment; extra --section.key value pairs override the recipe",
                           **recipe)
    add_config(fit_p)
    fit_p.add_argument("--ckpt-path", default=None, help="'last' resumes the run's last checkpoint, or a path")
    fit_p.add_argument("--slurm", action="store_true", help="submit this run as a SLURM job (sbatch) instead")
    fit_p.add_argument("--dry-run", action="store_true",
                       help="print the resolved config (with --slurm: the job script); train and submit nothing")
    add_slurm_args(fit_p, "fit")
    for name in ("validate", "test"):
        e = sub.add_parser(name, help=f"evaluate a checkpoint on the {name} split", **recipe)
        add_config(e)
        e.add_argument("--ckpt", required=True)
        e.add_argument("--beam", type=positive_int, default=None, help="beam size (default: decode.beam)")
        add_engine_arg(e)
        add_device_arg(e)
    demo = sub.add_parser("demo", help="fit + average + beam-search test BLEU: what `make demo` runs", **recipe)
    add_config(demo)
    add_device_arg(demo, "the decoding of the test split (training follows trainer.accelerator)")
    add_engine_arg(demo)
    tr = sub.add_parser("translate", help="translate lines from a file or stdin with a checkpoint")
    tr.add_argument("--ckpt", required=True, help="a checkpoint; it carries its tokenizer")
    tr.add_argument("--input", default="-")
    tr.add_argument("--beam", type=positive_int, default=None, help="beam size (default: decode.beam)")
    tr.add_argument("--threads", type=positive_int, default=None,
                    help="CPU threads: as many batches decoded at once, one thread each (default: torch's count, the "
                         "machine's cores); with --engine ctranslate2 its inter_threads")
    add_engine_arg(tr)
    add_device_arg(tr)
    gen = sub.add_parser("generate", help="sample from a language-model checkpoint")
    gen.add_argument("--ckpt", required=True)
    add_device_arg(gen)
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-new-tokens", type=int, default=GENERATE_MAX_NEW_TOKENS)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    bleu = sub.add_parser("bleu", help="sacreBLEU/chrF of a hypothesis file; --compound-split adds the paper's BLEU")
    bleu.add_argument("--hyp", required=True, help="hypotheses, detokenised, one sentence a line")
    bleu.add_argument("--ref", required=True, help="references, detokenised, line-aligned with --hyp")
    bleu.add_argument("--compound-split", action="store_true",
                      help="also Moses-tokenised BLEU with ##AT## compound splitting (get_ende_bleu.sh)")
    bleu.add_argument("--lang", default="de", type=target_language, help="target language (de, zh_CN), or a pair as "
                      "sacreBLEU's -l (en-zh): its tokenizer (zh, ja-mecab, ko-mecab, else 13a) and the Moses "
                      "tokenizer's language for --compound-split")
    bleu.add_argument("--json", default=None, help="also write the scores to this JSON file")
    avg = sub.add_parser("average", help="average checkpoints (the last N of a run, or those given)")
    avg.add_argument("--run-dir", default=None)
    avg.add_argument("--last", type=int, default=5)
    avg.add_argument("--ckpts", nargs="*", default=None)
    avg.add_argument("--out", default=None)
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face (Llama, Marian) or CTranslate2 model")
    ex.add_argument("--ckpt", required=True)
    ex.add_argument("--format", choices=("hf", "ctranslate2"), default="hf",
                    help="hf: safetensors + config.json + tokenizer; ctranslate2: a CTranslate2 model folder with the "
                         "tokenizer (the ctranslate2 extra)")
    ex.add_argument("--out", required=True, help="output folder (created; must be empty if it exists)")
    ex.add_argument("--quantization", default=None,
                    help="ctranslate2 only: the weights' type, e.g. int8 (default: float32, as trained)")
    add_ablate_commands(sub)
    return p


COMMANDS = {"ablate": cmd_ablate, "info": cmd_info, "fit": cmd_fit, "demo": cmd_demo, "validate": cmd_eval,
            "test": cmd_eval, "translate": cmd_translate, "generate": cmd_generate, "average": cmd_average,
            "bleu": cmd_bleu, "export": cmd_export}


def quiet_third_party(verbose: bool) -> None:
    """attnlab's own INFO lines; Lightning's banners (accelerator, tips) only with -v, and each line once.

    Lightning adds its own INFO handler to the `lightning` logger when imported (and resets its level); it is
    imported at the top of this module, and its handler is removed here: its lines then go through the root
    handler, at WARNING unless -v. Two warnings it raises on every run say nothing actionable here: `srun is
    available but not used` on any machine with SLURM installed (a SLURM job runs under srun), and a
    deprecation inside Lightning's own pytree helper."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("attnlab").setLevel(logging.INFO)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
        lg.setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        warnings.filterwarnings("ignore", message=r".*`srun` command is available on your system but is not used")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    quiet_third_party(args.verbose)
    try:
        check_options(args.parser, rest)
        overrides = parse_overrides(rest)
        if overrides and args.command not in ("fit", "validate", "test", "demo", "ablate"):
            raise ConfigError(f"attnlab {args.command} takes no --section.key overrides: {list(overrides)}")
        if getattr(args, "print_config", False):
            print(load_experiment(args.config, overrides).to_yaml(), end="")
            return 0
        fn = COMMANDS[args.command]
        return fn(args) if args.command == "info" else fn(args, overrides)
    except DiskFull as e:  # what was saved before is whole: the message says where and how much space it needs
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
            PermissionError) as e:  # a path or value the user gave: one line naming it
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
