#!/usr/bin/env bash
# Every check and figure attnlab needs from a GPU, written under one folder, in parts that each fit one call of a
# machine lent a few minutes at a time. See "One command on a GPU" in bench/README.md.
#
#   bash bench/gpu_carry.sh                                  # here, where PyPI is: what a bare GPU machine lacks
#   bash bench/gpu_run.sh --carry .carry --part 1 --out DIR  # there: installs attnlab and the carried wheels, runs
#   bash bench/gpu_run.sh --carry .carry --part 2 --out DIR  #   part 1, then part 2, ... into the same folder
#   bash bench/gpu_run.sh --dry-run                          # every step at toy size on a CPU
#   bash bench/gpu_run.sh --only train_compile,decode --out DIR   # some steps by name
#   bash bench/gpu_run.sh --only base_bleu --base-args "--model.norm_position post" --out DIR   # a variant of it
#
# Parts, the most important figures first (minutes measured on one H100, pytest's start and compiling included):
#   1 gpu_tests       tests/test_gpu.py (kernels, bf16 against fp32, the fused loss, CUDA-graph decoding)
#     train_compile   bench/train_throughput.py, torch.compile: attnlab with and without the fused loss beside
#                     x-transformers, enc-dec and LM (TRAIN_COMPILE_ROWS)               -> train_compile.json
#   2 base_fit        a real fit of the base model's 5-minute shape (base_bleu's settings) for 2 minutes
#     base_bench      the benchmark at that run's shape; fit_vs_bench.py: the fit's tokens/s by wall clock over
#                     the benchmark's                                       -> base_bench.json, base_fit.json
#     decode_ct2      that model's test split decoded by attnlab and by CTranslate2 on CUDA, greedy and beam 4,
#                     attnlab also in batches of 256 and 1,024 sentences (bench/decode_vs_ct2.py) -> decode_ct2.json
#   3 base_bleu       experiments/wmt14_en_de_base.yaml at full size on gettext:de, 5 minutes, checkpoints
#                     averaged at the lowest validation loss, beam-4 test BLEU and chrF (attnlab demo)
#                                                                        -> base_bleu.json, base_translations.jsonl
#   4 base_peer       the hand-written torch.nn.Transformer peer (carried: peers/peer_demo.py) for 5 minutes (--minutes) on
#                     base_bleu's own split, scored on the same test sentences; builds that split
#                     itself where part 3 did not run into the same --out (bench/base_split.py)
#                                                                                -> base_peer.json, base_vs_peer.json
#   5 ablation        ablations/demo_norm_ffn.yaml packed on the GPU at each --workers-per-gpu (default 8,16)
#                                                                    -> ablation_w<N>.txt, trials per hour in summary.md
#   6 train_eager     bench/train_throughput.py, eager, every peer                             -> train_eager.json
#     decode          bench/decode_throughput.py (against HF Marian and HF Llama)              -> decode.json
#     padded_attn(_sorted)  attention over padded batches by each route (bench/padded_attention.py)
#     demo_fit, demo_bench  the demo recipe's fit for 2 minutes in bf16 beside its benchmark   -> demo_fit.json
# No --part and no --only: every part in order. Each step runs under a time limit of its own, writes its JSON as it
# ends, and the next one runs whatever happens; the script exits 1 when a step failed or timed out. Every step's
# output is in <out>/<step>.log; <out>/summary.md has one line per step (status, seconds).
#
# --carry DIR (made by bench/gpu_carry.sh): pip-installs DIR/wheels/*.whl (--no-deps: the machine's own torch stays)
# and attnlab itself (--no-deps -e .), reads the catalogs from DIR/locale and the peer from DIR/peers.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0; OUT=""; LOCALE=""; WHEELS=""; CARRY=""; PY="${PYTHON:-}"; ONLY=""; PART=""; WPG=""; SEEDS=""; BASE_ARGS=""; MINUTES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY=",$2,"; shift ;;
    --part) PART="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --carry) CARRY="$2"; shift ;;
    --locale) LOCALE="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --workers-per-gpu) WPG="$2"; shift ;;  # the ablation step's trials at once on the GPU, comma-separated
    --seeds) SEEDS="$2"; shift ;;          # the ablation step's seeds, comma-separated (default: the spec's)
    --base-args) BASE_ARGS="$2"; shift ;;  # more overrides for base_fit's and base_bleu's runs (one string)
    --minutes) MINUTES="$2"; shift ;;      # base_bleu's and base_peer's training time, the same for both (default 5)
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PARTS=(""
  "gpu_tests,train_compile"
  "base_fit,base_bench,decode_ct2"
  "base_bleu"
  "base_peer"
  "ablation"
  "train_eager,decode,padded_attn,padded_attn_sorted,demo_fit,demo_bench")
if [ -n "$PART" ]; then
  [[ "$PART" =~ ^[1-6]$ ]] || { echo "gpu_run.sh: --part $PART: give 1 to 6 (see --help)" >&2; exit 2; }
  [ -z "$ONLY" ] || { echo "gpu_run.sh: give --part or --only, not both" >&2; exit 2; }
  ONLY=",${PARTS[$PART]},"
fi
read -r -a BASE_ARGV <<< "$BASE_ARGS"  # words, not globbed
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${OUT:-gpu_runs/$(date -u +%Y%m%d-%H%M%S)$([ "$DRY" = 1 ] && echo -dry)}"
mkdir -p "$OUT" || { echo "gpu_run.sh: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"

# ------------------------------------------------------------------------------------------------ preflight
fail() { echo "gpu_run.sh: $*" >&2; exit 2; }
PEER=../shared/peers/peer_demo.py
if [ -n "$CARRY" ]; then
  [ -d "$CARRY/wheels" ] || fail "--carry $CARRY: no wheels folder there (make it with bash bench/gpu_carry.sh)"
  WHEELS="$CARRY/wheels"; LOCALE="${LOCALE:-$CARRY/locale}"; PEER="$CARRY/peers/peer_demo.py"
fi
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || fail "--wheels $WHEELS: no such folder"
  # --no-deps: a wheel's needs are the machine's own (a torch wheel pulled in here would replace its CUDA build)
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir "$WHEELS"/*.whl \
    || fail "installing the wheels in $WHEELS failed"
fi
if [ -n "$CARRY" ]; then  # attnlab itself, from this checkout, with no network: the machine's build tools
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || { echo "note: pip install -e . failed here; attnlab runs from src/ on PYTHONPATH"; \
         export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; }
fi
"$PY" -c "import attnlab" 2>/dev/null || fail "$PY cannot import attnlab: run 'make venv' (or pip install -e '.[dev]') first"
if [ "$DRY" = 0 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || fail "no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); --dry-run runs on a CPU"
fi
LOCALE="${LOCALE:-/usr/share/locale}"
ls "$LOCALE"/de/LC_MESSAGES/*.mo >/dev/null 2>&1 \
  || fail "no gettext catalogs in $LOCALE/de/LC_MESSAGES: the translation steps read them. Make them travel with bash bench/gpu_carry.sh and pass --carry .carry (or --locale DIR)"
LOCALE="$(cd "$LOCALE" && pwd)"
"$PY" -c "import x_transformers" 2>/dev/null || echo "note: x-transformers is not installed: its benchmark rows say skipped (bench/gpu_carry.sh carries it)"

# ------------------------------------------------------------------------------------------------ steps
export PYTHONUNBUFFERED=1
# the commit every JSON names (bench/harness.py's provenance): ATTNLAB_GIT_COMMIT / ATTNLAB_GIT_DIRTY as the caller
# set them (a lent machine's copy of the tree may come with a .git whose HEAD is not the tree's: on 2026-11-26 it
# said f737cdd for a tree of 90e7d2e), else git's
if [ -z "${ATTNLAB_GIT_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
  export ATTNLAB_GIT_COMMIT="$(git rev-parse HEAD)"
  export ATTNLAB_GIT_DIRTY="$(git diff --quiet HEAD 2>/dev/null && echo false || echo true)"
fi
SUMMARY="$OUT/summary.md"
[ -f "$SUMMARY" ] || {
  echo "# gpu_run $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY" = 1 ] && echo ' (dry run: toy sizes on a CPU)')"
  echo
  echo "- commit: ${ATTNLAB_GIT_COMMIT:-not recorded}$([ "${ATTNLAB_GIT_DIRTY:-}" = true ] && echo ' (with uncommitted changes)')"
  echo "- $("$PY" -c 'import torch; d = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"; print(f"device: {d}; torch {torch.__version__}, CUDA {torch.version.cuda}")')"
  echo "- driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || echo none)"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

wanted() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }
record() { echo "| $1 | $2 | $3 |" >> "$SUMMARY"; echo "   $2 in $3 s"; }
step() {  # step NAME LIMIT_SECONDS COMMAND...: run it under a time limit, log its output, record the outcome
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS status
  wanted "$name" || return 0
  echo "== $name (limit ${limit}s, $(date -u +%H:%M:%S) UTC): $*"
  timeout --signal=TERM --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  case $? in 0) status=ok ;; 124|137) status="timed out" ;; *) status="failed (see $name.log)" ;; esac
  record "$name" "$status" $((SECONDS - t0))
}
copy_if() { [ -f "$1" ] && cp "$1" "$2"; return 0; }
# the benchmark row whose loss a fit took: Liger's where it ran (trainer.fused_loss auto takes it on CUDA), else plain
fit_row() { "$PY" -c "
import json, sys
ok = {r['model'] for r in json.load(open(sys.argv[1]))['rows'] if r.get('status') == 'ok'}
print('encdec/attnlab-liger' if 'attnlab-liger' in ok else 'encdec/attnlab')" "$1" 2>/dev/null || echo encdec/attnlab; }

ATTNLAB=("$PY" -m attnlab)
DATA=(--data.locale_dir "$LOCALE" --trainer.runs_dir "$OUT/runs" --trainer.progress_bar false)
# the base model's runs share one data cache: base_peer trains and tests on that split, like for like
BASE=(-c experiments/wmt14_en_de_base.yaml "${DATA[@]}" --data.data_dir "$OUT/data_base" --data.corpus gettext:de
      --trainer.devices 1 --trainer.strategy auto)
if [ "$DRY" = 1 ]; then  # toy sizes: every step runs its real code path in seconds on a CPU
  TINY=(--model.d_model 32 --model.n_heads 2 --model.n_enc_layers 1 --model.n_dec_layers 1 --model.d_ff 64
        --data.vocab_size 300 --data.max_tokens 512 --decode.max_len_a 0 --decode.max_len_b 4
        --decode.val_sentences 8 --trainer.val_every 1000 --trainer.ckpt_every 2 --trainer.log_every 2)
  BENCH=(--cpu --steps 1 --warmup 1)
  FIT_ROWS=encdec/attnlab
  TRAIN_COMPILE=("${BENCH[@]}" --compile-backend eager --only encdec/attnlab,lm/attnlab)
  FIT_TIME=0.15; BASE_FIT_TIME=0.15; BASE_TIME=0.15; DEMO_EXTRA=("${TINY[@]}")
  BASE_EXTRA=("${TINY[@]}" --decode.beam 2 --trainer.val_every 4 --model.dropout 0.3 --decode.average_at best)
  PEER_ARGS=(--device cpu --minutes 0.05 --d 32 --layers 1 --ff 64 --heads 2 --vocab 300)
  CT2=(--device cpu --threads 1 --limit 20 --repeats 1 --more-batches 8)
  ABLATION_EXTRA='{"budget": {"steps": 4}, "final_eval": false}'
  WPG_LIST=(0)  # 0: --workers 2, no GPU
  # each step takes seconds alone; its limit is a last resort sized for a loaded machine (the suite runs this
  # beside three other pytest-xdist workers on 2 cores: decode_ct2 ran out of 120 s there, 24 s alone)
  L_TESTS=600; L_COMPILE=600; L_BENCH=600; L_CT2=600; L_PEER=600; L_ABL=600; L_PAD=480
else
  BENCH=()
  FIT_ROWS=encdec/attnlab,encdec/attnlab-liger  # the fit takes Liger's loss where it runs: fit_row picks its row
  # attnlab with the plain loss and with Liger's (whole model compiled, and trainer.compile's compiled blocks, what
  # a fit runs), beside x-transformers; Liger beat CCE on the LM (bench/RESULTS.md, 2026-11-26) and CCE refuses the
  # enc-dec's label smoothing. About 35 s a row on an H100, compiling included
  TRAIN_COMPILE=(--profile --only "${TRAIN_COMPILE_ROWS:-encdec/attnlab,encdec/attnlab-liger,encdec/attnlab-blocks-liger,encdec/x-transformers,lm/attnlab,lm/attnlab-liger,lm/attnlab-blocks-liger,lm/x-transformers}")
  FIT_TIME=2; BASE_FIT_TIME=2; BASE_TIME=5; DEMO_EXTRA=()
  # the base model at full size, sized for 5 minutes on one GPU: gettext's ~40k pairs (a 37k vocabulary would be
  # most of the corpus), twice the paper's per-GPU slots a step, the checkpoint spacing a short run averages over.
  # Pre-norm (the 5-minute peer's block), Noam with warmup 1,000 and lr 0.7 (peak 9.8e-4 at step 1,000). The
  # paper's post-norm block stalled at the unigram loss with warmup 1,000 (H100: BLEU 0.05 and 0.07; the CPU at
  # 1,024 slots: the same stall, where pre-norm at this schedule kept falling), and at the paper's warmup 4,000 it
  # was still warming up after 5 minutes (H100: BLEU 25.6). bench/RESULTS.md. The 2026-11-26 run memorised its
  # 40k pairs (training NLL 0.14 nats, the validation loss lowest at step 2,999 of 7,574): dropout 0.3 (fairseq's
  # small-data transformer_iwslt_de_en) and the checkpoints averaged at the lowest validation loss.
  # --base-args overrides these: "--model.norm_position post --optim.lr 1.0 --optim.warmup_steps 4000" runs the
  # paper's own.
  BASE_EXTRA=(--data.vocab_size 8000 --data.max_tokens 8192 --trainer.ckpt_every 250 --trainer.val_every 1500
              --decode.val_sentences 200 --model.norm_position pre --optim.lr 0.7 --optim.warmup_steps 1000
              --model.dropout 0.3 --decode.average_at best)
  PEER_ARGS=(--device cuda --minutes 5 --d 512 --layers 6 --ff 2048 --heads 8)
  CT2=(--device cuda --more-batches 256,1024)  # attnlab also in bigger batches than the recipe's 64 sentences
  ABLATION_EXTRA='{}'
  IFS=, read -r -a WPG_LIST <<< "${WPG:-8,16}"
  L_TESTS=180; L_COMPILE=420; L_BENCH=180; L_CT2=240; L_PEER=480; L_ABL=300; L_PAD=0
fi
if [ -n "$MINUTES" ]; then  # a shorter like-for-like pair: attnlab's base model and the peer get the same minutes
  [[ "$MINUTES" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "gpu_run.sh: --minutes $MINUTES: give a number of minutes" >&2; exit 2; }
  BASE_TIME=$MINUTES
  for i in "${!PEER_ARGS[@]}"; do [ "${PEER_ARGS[$i]}" = --minutes ] && PEER_ARGS[$((i + 1))]=$MINUTES; done
fi

# ---- part 1: the GPU tests; compiled training with and without the fused loss, beside x-transformers
step gpu_tests $L_TESTS "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
step train_compile $L_COMPILE "$PY" bench/train_throughput.py --modes compile --tasks encdec,lm "${TRAIN_COMPILE[@]}" \
  --json "$OUT/train_compile.json"

# ---- part 2: a real fit of the base shape beside its benchmark by wall clock; its model decoded beside CTranslate2
BASE_FIT_RUN="$OUT/runs/gpu_base_fit"
step base_fit $((L_PAD + 120 + ${BASE_FIT_TIME%.*} * 60)) "${ATTNLAB[@]}" fit "${BASE[@]}" --trainer.run_name gpu_base_fit \
  --trainer.max_time_min "$BASE_FIT_TIME" "${BASE_EXTRA[@]}" "${BASE_ARGV[@]}"
step base_bench $L_BENCH "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager --tasks encdec \
  --only "$FIT_ROWS" --recipe "$BASE_FIT_RUN/config.yaml" --json "$OUT/base_bench.json"
wanted base_bench && "$PY" bench/fit_vs_bench.py "$BASE_FIT_RUN" "$OUT/base_bench.json" --json "$OUT/base_fit.json" \
  --row "$(fit_row "$OUT/base_bench.json")" \
  | tee -a "$OUT/base_bench.log"
# CTranslate2's wheels (4.8.5) open CUDA 12's cuBLAS by name, libcublas.so.12. Where the machine has only CUDA 13's
# (torch's, on the H100 image), CTranslate2 gets that name for it, a link in <out>/cuda12_names on its library
# path: the nine cuBLAS functions it calls keep their signatures in cuBLAS 13. decode_ct2.json names the cuBLAS
# file each CTranslate2 row ran on.
CT2_ENV=()
if [ "$DRY" = 0 ] && wanted decode_ct2 && ! "$PY" -c "import ctypes; ctypes.CDLL('libcublas.so.12')" 2>/dev/null; then
  CUBLAS13=$("$PY" -c "
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
found = [p for r in roots for p in glob.glob(os.path.join(r, 'nvidia', '**', 'libcublas.so.13'), recursive=True)]
print(found[0] if found else '')" 2>/dev/null)
  [ -n "$CUBLAS13" ] || CUBLAS13=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF; exit}')
  if [ -n "$CUBLAS13" ]; then
    mkdir -p "$OUT/cuda12_names"
    ln -sf "$CUBLAS13" "$OUT/cuda12_names/libcublas.so.12"
    for lt in "$(dirname "$CUBLAS13")"/libcublasLt.so.13*; do [ -e "$lt" ] && ln -sf "$lt" "$OUT/cuda12_names/"; done
    CT2_ENV=(env "LD_LIBRARY_PATH=$OUT/cuda12_names${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    echo "note: no libcublas.so.12 here: CTranslate2 runs on $CUBLAS13 through that name"
  else
    echo "note: neither libcublas.so.12 nor .so.13 found: the CTranslate2 rows will say why they failed"
  fi
fi
step decode_ct2 $L_CT2 "${CT2_ENV[@]}" "$PY" bench/decode_vs_ct2.py \
  --ckpt "$BASE_FIT_RUN/checkpoints/last.ckpt" "${CT2[@]}" --json "$OUT/decode_ct2.json"

# ---- part 3: the base model for BLEU: train, average, beam-4 test BLEU and chrF (attnlab demo does all three)
step base_bleu $((L_PAD + 150 + ${BASE_TIME%.*} * 60)) "${ATTNLAB[@]}" demo "${BASE[@]}" --trainer.run_name gpu_base \
  --trainer.max_time_min "$BASE_TIME" "${BASE_EXTRA[@]}" "${BASE_ARGV[@]}"
if wanted base_bleu; then
  copy_if "$OUT/runs/gpu_base/demo_results.json" "$OUT/base_bleu.json"
  copy_if "$OUT/runs/gpu_base/demo_translations.jsonl" "$OUT/base_translations.jsonl"  # where the BLEU goes
  copy_if "$OUT/runs/gpu_base/config.yaml" "$OUT/base_bleu_config.yaml"
  [ -f "$OUT/base_bench.json" ] && "$PY" bench/fit_vs_bench.py "$OUT/runs/gpu_base" "$OUT/base_bench.json" \
    --row "$(fit_row "$OUT/base_bench.json")" \
    --json "$OUT/base_bleu_fit.json" | tee -a "$OUT/base_bleu.log"
fi

# ---- part 4: the hand-written peer on base_bleu's split (its test sentences; no source of valid or test in training)
if wanted base_peer; then
  SPLIT=$(for d in "$OUT"/data_base/*/; do [ -f "${d}test.jsonl" ] && echo "$d"; done | head -1)
  if [ ! -f "$PEER" ]; then
    echo "== base_peer: no peer at $PEER (bench/gpu_carry.sh carries ../shared/peers/peer_demo.py)"
    record base_peer "skipped (no peer at $PEER)" 0
  else
    if [ -z "$SPLIT" ]; then  # a fresh machine without part 3's run: build the split part 3 would train and test on
      echo "== base_peer: no split under $OUT/data_base (part 3 not run into this --out): building it"
      SPLIT=$("$PY" bench/base_split.py "${BASE[@]}" "${BASE_EXTRA[@]}" "${BASE_ARGV[@]}" 2>>"$OUT/base_peer.log" \
              | tail -1)/
      [ -f "${SPLIT}test.jsonl" ] || SPLIT=""
    fi
    if [ -z "$SPLIT" ]; then
      echo "== base_peer: could not build the split under $OUT/data_base (see base_peer.log)"
      record base_peer "failed (no split under $OUT/data_base: see base_peer.log)" 0
    else
      PEER_TEST="${SPLIT}test.jsonl"
      if [ "$DRY" = 1 ]; then  # a toy peer decodes up to 1.5 x the source + 10 tokens a sentence: test on 40
        PEER_TEST="$OUT/peer_test_head.jsonl"; head -40 "${SPLIT}test.jsonl" > "$PEER_TEST"
      fi
      # the test file first (the peer tests on it); no source of any of these files is trained on
      step base_peer $L_PEER "$PY" "$PEER" --split-from "$PEER_TEST" "${SPLIT}test.jsonl" "${SPLIT}valid.jsonl" \
        --locale-dir "$LOCALE" --hyp-out "$OUT/base_peer_hyps.txt" "${PEER_ARGS[@]}"
      "$PY" bench/peer_score.py "$PEER_TEST" "$OUT/base_peer_hyps.txt" --log "$OUT/base_peer.log" \
        --attnlab "$OUT/base_bleu.json" --json "$OUT/base_peer.json" | tee -a "$OUT/base_peer.log"
    fi
  fi
fi

# ---- part 5: the ablation packed onto the GPU, its data and runs under <out>/ablation[_w<workers per GPU>]
for W in "${WPG_LIST[@]}"; do
  wanted ablation || break
  ADIR="$OUT/ablation$([ "$W" != 0 ] && echo "_w$W")"
  ABLATION="$ADIR.yaml"
  "$PY" - "$ABLATION" "$LOCALE" "$ADIR" "$ABLATION_EXTRA" "$DRY" "$SEEDS" <<'EOF'
import json, sys
from pathlib import Path
import yaml
out, locale, root, extra, dry = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == "1"
seeds = sys.argv[6]
spec = yaml.safe_load(Path("ablations/demo_norm_ffn.yaml").read_text(encoding="utf-8"))
spec["base"] = str(Path("experiments/demo_en_de.yaml").resolve())
over = spec.setdefault("overrides", {})
over.update({"data.locale_dir": locale, "trainer.runs_dir": f"{root}/runs", "trainer.progress_bar": False})
if dry:
    over.update({"model.d_model": 32, "model.n_heads": 2, "model.n_enc_layers": 1, "model.n_dec_layers": 1,
                 "model.d_ff": 64, "data.vocab_size": 300, "data.max_tokens": 512, "trainer.val_every": 2,
                 "trainer.ckpt_every": 2, "decode.val_sentences": 8, "decode.max_len_a": 0, "decode.max_len_b": 4})
spec.update(extra)
if seeds:
    spec["seeds"] = [int(x) for x in seeds.split(",")]
out.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
EOF
  if [ "$W" = 0 ]; then WORKERS=(--workers 2); else WORKERS=(--workers-per-gpu "$W"); fi
  t_ablation=$SECONDS
  step ablation $L_ABL "${ATTNLAB[@]}" ablate run "$ABLATION" --dir "$ADIR" "${WORKERS[@]}"
  t_ablation=$((SECONDS - t_ablation))
  "${ATTNLAB[@]}" ablate table "$ABLATION" --dir "$ADIR" > "$ADIR.txt" 2>&1
  "$PY" - "$ADIR/table.csv" "$t_ablation" "${WORKERS[*]}" >> "$SUMMARY" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1], encoding="utf-8")))
n, seconds = sum(int(r["n"]) for r in rows), max(int(sys.argv[2]), 1)
print(f"\n- ablation ({sys.argv[3]}): {n} trials finished in {seconds} s: {3600 * n / seconds:.0f} trials per hour")
EOF
done

# ---- part 6: eager training beside every peer, decoding beside HF, padded attention, the demo recipe's fit
if [ "$DRY" = 1 ]; then
  step train_eager $L_BENCH "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager --only encdec/attnlab,lm/attnlab \
    --json "$OUT/train_eager.json"
  step decode $L_BENCH "$PY" bench/decode_throughput.py --cpu --repeats 1 --warmup 1 --tasks mt \
    --only mt/attnlab-greedy,mt/attnlab-beam4 --json "$OUT/decode.json"
  step padded_attn $L_BENCH "$PY" bench/padded_attention.py --dry-run --json "$OUT/padded_attn.json"
else
  step train_eager 240 "$PY" bench/train_throughput.py --modes eager --profile --json "$OUT/train_eager.json"
  step decode 300 "$PY" bench/decode_throughput.py --json "$OUT/decode.json"  # 180 s ran out on an H100
  # attention over padded batches: mixed lengths (about half padding), then a batch sorted by length
  step padded_attn 180 "$PY" bench/padded_attention.py --json "$OUT/padded_attn.json"
  step padded_attn_sorted 180 "$PY" bench/padded_attention.py --min-len 56 --max-len 72 \
    --json "$OUT/padded_attn_sorted.json"
fi
DEMO_RUN="$OUT/runs/gpu_demo_fit"
step demo_fit $((L_PAD + 180 + ${FIT_TIME%.*} * 60)) "${ATTNLAB[@]}" fit -c experiments/demo_en_de.yaml "${DATA[@]}" \
  --trainer.run_name gpu_demo_fit --trainer.max_time_min "$FIT_TIME" \
  $([ "$DRY" = 0 ] && echo --trainer.precision bf16-mixed) "${DEMO_EXTRA[@]}"
step demo_bench $L_BENCH "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager --tasks encdec \
  --only "$FIT_ROWS" --recipe "$DEMO_RUN/config.yaml" --json "$OUT/demo_bench.json"
wanted demo_bench && "$PY" bench/fit_vs_bench.py "$DEMO_RUN" "$OUT/demo_bench.json" --json "$OUT/demo_fit.json" \
  --row "$(fit_row "$OUT/demo_bench.json")" \
  | tee -a "$OUT/demo_bench.log"

echo
cat "$SUMMARY"
echo "everything is in $OUT"
grep -q "failed\|timed out" "$SUMMARY" && exit 1
exit 0
