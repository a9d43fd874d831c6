#!/usr/bin/env bash
# One command for a first half hour on a GPU: every check and figure attnlab needs from one, in about 25 minutes
# on one H100, written under one folder. See "One command on a GPU" in bench/README.md.
#
#   bash bench/gpu_run.sh [--out DIR] [--locale DIR] [--wheels DIR] [--python PY]
#   bash bench/gpu_run.sh --dry-run        # every step at toy size on a CPU, in about 2 minutes
#   bash bench/gpu_run.sh --only train_eager,decode --out DIR   # some steps (into the same folder as others)
#   bash bench/gpu_run.sh --only ablation --workers-per-gpu 8 --seeds 1,2 --out DIR   # the ablation's packing
#   bash bench/gpu_run.sh --only base_bleu --base-args "--model.norm_position post" --out DIR   # a variant of it
#
# Steps (each under its own time limit, so that one slow step cannot eat the rest; a failed step is recorded and
# the next one runs):
#   1 gpu_tests       tests/test_gpu.py (kernel names from the profiler, bf16 against fp32, CUDA-graph decoding)
#   2 train_eager     bench/train_throughput.py, eager, with the peers (+ attnlab profiles) -> train_eager.json
#   3 train_compile   bench/train_throughput.py, torch.compile, with the peers   -> train_compile.json
#   4 decode          bench/decode_throughput.py                                  -> decode.json
#     padded_attn     attention over padded batches by each route (SDPA with a mask, jagged tensors, FlexAttention,
#                     flash-attn varlen), mixed lengths and sorted (bench/padded_attention.py) -> padded_attn*.json
#   5 demo_fit        attnlab fit of experiments/demo_en_de.yaml, 2 minutes in bf16, and the benchmark at that
#                     recipe's shape                                            -> demo_fit.json (tokens/s of both)
#     decode_ct2      that model's test split decoded by attnlab and by CTranslate2 on CUDA (fp32, greedy and
#                     beam 4, bench/decode_vs_ct2.py)                            -> decode_ct2.json
#   6 base_bleu       experiments/wmt14_en_de_base.yaml at full size on gettext:de, pre-norm, 5 minutes on one GPU,
#                     the last checkpoints averaged, beam-4 test BLEU (attnlab demo) -> base_bleu.json
#     base_bench      the benchmark at that run's shape, beside its tokens/s     -> base_fit.json
#   7 ablation        ablations/demo_norm_ffn.yaml, --workers-per-gpu 4 (or N)   -> ablation_w4.txt (its table)
# Every step's output is in <out>/<step>.log; <out>/summary.md has one line per step (status, seconds).
#
# A GPU machine without internet brings what it lacks (prepared where pip and the catalogs are):
#   wheels:   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
#                 -d wheels x-transformers==2.31.10 einx==0.4.3 loguru==0.7.3 torch-einops-utils==0.2.0 \
#                 frozendict==2.5.1 einops==0.8.2 ctranslate2==4.8.5          (then --wheels wheels)
#             (the GPU machine's Python version; --no-deps: the peers' own needs, torch among them, are there)
#   catalogs: mkdir -p locale && cp -r /usr/share/locale/de locale/                 (then --locale locale)
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0; OUT=""; LOCALE=""; WHEELS=""; PY="${PYTHON:-}"; ONLY=""; WPG=4; SEEDS=""; BASE_ARGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY=",$2,"; shift ;;
    --out) OUT="$2"; shift ;;
    --locale) LOCALE="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --workers-per-gpu) WPG="$2"; shift ;;  # the ablation step's trials at once on the GPU (default 4)
    --seeds) SEEDS="$2"; shift ;;          # the ablation step's seeds, comma-separated (default: the spec's)
    --base-args) BASE_ARGS="$2"; shift ;;  # more overrides for base_bleu's run, after its own (one string)
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
read -r -a BASE_ARGV <<< "$BASE_ARGS"  # words, not globbed
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${OUT:-gpu_runs/$(date -u +%Y%m%d-%H%M%S)$([ "$DRY" = 1 ] && echo -dry)}"
mkdir -p "$OUT" || { echo "gpu_run.sh: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"

# ------------------------------------------------------------------------------------------------ preflight
fail() { echo "gpu_run.sh: $*" >&2; exit 2; }
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || fail "--wheels $WHEELS: no such folder"
  # --no-deps: a wheel's needs are the machine's own (a torch wheel pulled in here would replace its CUDA build)
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || fail "installing the wheels in $WHEELS failed"
fi
"$PY" -c "import attnlab" 2>/dev/null || fail "$PY cannot import attnlab: run 'make venv' (or pip install -e '.[dev]') first"
if [ "$DRY" = 0 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || fail "no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); --dry-run runs on a CPU"
fi
LOCALE="${LOCALE:-/usr/share/locale}"
ls "$LOCALE"/de/LC_MESSAGES/*.mo >/dev/null 2>&1 \
  || fail "no gettext catalogs in $LOCALE/de/LC_MESSAGES: the translation steps read them. Copy a machine's catalogs (mkdir -p locale && cp -r /usr/share/locale/de locale/) and pass --locale locale"
LOCALE="$(cd "$LOCALE" && pwd)"
"$PY" -c "import x_transformers" 2>/dev/null || echo "note: x-transformers is not installed: its benchmark rows say skipped (see --help for bringing it)"

# ------------------------------------------------------------------------------------------------ steps
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
[ -f "$SUMMARY" ] || {
  echo "# gpu_run $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY" = 1 ] && echo ' (dry run: toy sizes on a CPU)')"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- $("$PY" -c 'import torch; d = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"; print(f"device: {d}; torch {torch.__version__}")')"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
} > "$SUMMARY"

wanted() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }
step() {  # step NAME LIMIT_SECONDS COMMAND...: run it under a time limit, log its output, record the outcome
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS status
  wanted "$name" || return 0
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=TERM --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  case $? in 0) status=ok ;; 124|137) status="timed out" ;; *) status="failed (see $name.log)" ;; esac
  echo "| $name | $status | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "   $status in $((SECONDS - t0)) s"
}

ATTNLAB=("$PY" -m attnlab)
DATA=(--data.locale_dir "$LOCALE" --trainer.runs_dir "$OUT/runs" --trainer.progress_bar false)
if [ "$DRY" = 1 ]; then  # toy sizes: every step runs its real code path in seconds on a CPU
  TINY=(--model.d_model 32 --model.n_heads 2 --model.n_enc_layers 1 --model.n_dec_layers 1 --model.d_ff 64
        --data.vocab_size 300 --data.max_tokens 512 --decode.max_len_a 0 --decode.max_len_b 4
        --decode.val_sentences 8 --trainer.val_every 1000 --trainer.ckpt_every 2 --trainer.log_every 2)
  BENCH=(--cpu --steps 1 --warmup 1)
  step gpu_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
  step train_eager 120 "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager --only encdec/attnlab,lm/attnlab \
    --json "$OUT/train_eager.json"
  step train_compile 120 "$PY" bench/train_throughput.py "${BENCH[@]}" --modes compile --compile-backend eager \
    --only encdec/attnlab,encdec/attnlab-blocks --tasks encdec --json "$OUT/train_compile.json"
  step decode 120 "$PY" bench/decode_throughput.py --cpu --repeats 1 --warmup 1 --tasks mt \
    --only mt/attnlab-greedy,mt/attnlab-beam4 --json "$OUT/decode.json"
  step padded_attn 120 "$PY" bench/padded_attention.py --dry-run --json "$OUT/padded_attn.json"
  FIT_TIME=0.15; BASE_TIME=0.15; DEMO_EXTRA=("${TINY[@]}"); BASE_EXTRA=("${TINY[@]}" --decode.beam 2)
  ABLATION_EXTRA='{"budget": {"steps": 4}, "final_eval": false}'
  WORKERS=(--workers 2)
else
  step gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
  step train_eager 240 "$PY" bench/train_throughput.py --modes eager --profile --json "$OUT/train_eager.json"
  step train_compile 540 "$PY" bench/train_throughput.py --modes compile --profile --json "$OUT/train_compile.json"  # 11 rows, ~40 s each
  step decode 300 "$PY" bench/decode_throughput.py --json "$OUT/decode.json"  # 180 s ran out on an H100
  # attention over padded batches: mixed lengths (about half padding), then a batch sorted by length
  step padded_attn 180 "$PY" bench/padded_attention.py --json "$OUT/padded_attn.json"
  step padded_attn_sorted 180 "$PY" bench/padded_attention.py --min-len 56 --max-len 72 \
    --json "$OUT/padded_attn_sorted.json"
  BENCH=()
  FIT_TIME=2; BASE_TIME=5; DEMO_EXTRA=()
  # the base model at full size, sized for 5 minutes on one GPU: gettext's ~40k pairs (a 37k vocabulary would be
  # most of the corpus), twice the paper's per-GPU slots a step, the checkpoint spacing a short run averages over.
  # Pre-norm (the 5-minute peer's block), Noam with warmup 1,000 and lr 0.7 (peak 9.8e-4 at step 1,000). The
  # paper's post-norm block stalled at the unigram loss with warmup 1,000 (H100: BLEU 0.05 and 0.07; the CPU at
  # 1,024 slots: the same stall, where pre-norm at this schedule kept falling), and at the paper's warmup 4,000 it
  # was still warming up after 5 minutes (H100: BLEU 25.6). bench/RESULTS.md. --base-args overrides these:
  # --base-args "--model.norm_position post --optim.lr 1.0 --optim.warmup_steps 4000" runs the paper's own.
  BASE_EXTRA=(--data.vocab_size 8000 --data.max_tokens 8192 --trainer.ckpt_every 250 --trainer.val_every 1500
              --decode.val_sentences 200 --model.norm_position pre --optim.lr 0.7 --optim.warmup_steps 1000)
  ABLATION_EXTRA='{}'
  WORKERS=(--workers-per-gpu "$WPG")
fi

# 5: a real fit of the demo recipe in bf16, and the benchmark's step at the same shape, side by side
DEMO_RUN="$OUT/runs/gpu_demo_fit"
step demo_fit $((180 + ${FIT_TIME%.*} * 60)) "${ATTNLAB[@]}" fit -c experiments/demo_en_de.yaml "${DATA[@]}" \
  --trainer.run_name gpu_demo_fit --trainer.max_time_min "$FIT_TIME" \
  $([ "$DRY" = 0 ] && echo --trainer.precision bf16-mixed) "${DEMO_EXTRA[@]}"
step demo_bench $([ "$DRY" = 1 ] && echo 240 || echo 180) "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager --tasks encdec --only encdec/attnlab \
  --recipe "$DEMO_RUN/config.yaml" --json "$OUT/demo_bench.json"
wanted demo_bench && "$PY" bench/fit_vs_bench.py "$DEMO_RUN" "$OUT/demo_bench.json" --json "$OUT/demo_fit.json" \
  | tee -a "$OUT/demo_bench.log"
# attnlab's decoding beside CTranslate2's on the model just trained (issue: decoding as fast as CTranslate2)
# CTranslate2's wheels (4.8.5) open CUDA 12's cuBLAS by name, libcublas.so.12. Where the machine has only CUDA 13's
# (torch's, on the H100 image), CTranslate2 gets that name for it, a link in <out>/cuda12_names on its library
# path: the nine cuBLAS functions it calls keep their signatures in cuBLAS 13. decode_ct2.json names the cuBLAS
# file each CTranslate2 row ran on.
CT2_ENV=()
if [ "$DRY" = 1 ]; then CT2=(--device cpu --threads 1 --limit 20 --repeats 1); else CT2=(--device cuda); fi
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
step decode_ct2 $([ "$DRY" = 1 ] && echo 120 || echo 240) "${CT2_ENV[@]}" "$PY" bench/decode_vs_ct2.py \
  --ckpt "$DEMO_RUN/checkpoints/last.ckpt" "${CT2[@]}" --json "$OUT/decode_ct2.json"

# 6: the base model for BLEU: train, average the last checkpoints, beam-4 test BLEU (attnlab demo does all three)
step base_bleu $((300 + ${BASE_TIME%.*} * 60)) "${ATTNLAB[@]}" demo -c experiments/wmt14_en_de_base.yaml "${DATA[@]}" \
  --data.corpus gettext:de --trainer.devices 1 --trainer.strategy auto --trainer.run_name gpu_base \
  --trainer.max_time_min "$BASE_TIME" "${BASE_EXTRA[@]}" "${BASE_ARGV[@]}"
[ -f "$OUT/runs/gpu_base/demo_results.json" ] && cp "$OUT/runs/gpu_base/demo_results.json" "$OUT/base_bleu.json"
[ -f "$OUT/runs/gpu_base/demo_translations.jsonl" ] && cp "$OUT/runs/gpu_base/demo_translations.jsonl" \
  "$OUT/base_translations.jsonl"  # every test sentence with its hypothesis: where the BLEU goes
# the benchmark's step at that run's shape: does the loop or the shape cost the 5-minute run its tokens/s?
step base_bench $([ "$DRY" = 1 ] && echo 240 || echo 180) "$PY" bench/train_throughput.py "${BENCH[@]}" --modes eager \
  --tasks encdec --only encdec/attnlab --recipe "$OUT/runs/gpu_base/config.yaml" --json "$OUT/base_bench.json"
wanted base_bench && "$PY" bench/fit_vs_bench.py "$OUT/runs/gpu_base" "$OUT/base_bench.json" \
  --json "$OUT/base_fit.json" | tee -a "$OUT/base_bench.log"

# 7: the CPU ablation packed onto the GPU, its data and runs under <out>/ablation[_w<workers per GPU>]
ADIR="$OUT/ablation$([ "$DRY" = 0 ] && echo "_w$WPG")"
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
t_ablation=$SECONDS
step ablation $([ "$DRY" = 1 ] && echo 240 || echo 600) "${ATTNLAB[@]}" ablate run "$ABLATION" --dir "$ADIR" \
  "${WORKERS[@]}"
t_ablation=$((SECONDS - t_ablation))
wanted ablation && "${ATTNLAB[@]}" ablate table "$ABLATION" --dir "$ADIR" > "$ADIR.txt" 2>&1
wanted ablation && "$PY" - "$ADIR/table.csv" "$t_ablation" "${WORKERS[*]}" >> "$SUMMARY" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1], encoding="utf-8")))
n, seconds = sum(int(r["n"]) for r in rows), max(int(sys.argv[2]), 1)
print(f"\n- ablation ({sys.argv[3]}): {n} trials finished in {seconds} s: {3600 * n / seconds:.0f} trials per hour")
EOF

echo
cat "$SUMMARY"
echo "everything is in $OUT"
grep -q "failed\|timed out" "$SUMMARY" && exit 1
exit 0
