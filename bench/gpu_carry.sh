#!/usr/bin/env bash
# Fill one folder with what a bare GPU machine lacks for bench/gpu_run.sh, here, where PyPI and the gettext
# catalogs are; the folder then travels with the working tree (the device tool's `carry`) and
# `bash bench/gpu_run.sh --carry DIR --part 1` installs it there.
#
#   bash bench/gpu_carry.sh [--out DIR] [--python PY] [--peer FILE] [--budget-mib N]
#
#   DIR/wheels/   the wheels of bench/gpu_wheels.txt, for the device's Python 3.12 on x86-64 Linux (--no-deps:
#                 their own needs are the image's, bench/gpu_image.txt; a torch pulled in here would replace its
#                 CUDA build). Each need of each wheel is checked to be carried or in the image.
#   DIR/locale/   the German gettext catalogs (de/LC_MESSAGES/*.mo): the translation steps' data
#   DIR/peers/    the hand-written torch.nn.Transformer peer of the base-model step (--peer, default
#                 ../shared/peers/peer_demo.py beside this checkout), where there is one
#   DIR/MANIFEST.txt  what is there, its size, the commit it was made for
#
# Default DIR: .carry (ignored by git). Re-running keeps the wheels already there. It fails, naming the file,
# when the folder and the tracked tree together exceed --budget-mib (default 64, the device tool's limit).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.carry; PY="${PYTHON:-}"; PEER=../shared/peers/peer_demo.py; BUDGET=64
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --peer) PEER="$2"; shift ;;
    --budget-mib) BUDGET="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_carry.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
fail() { echo "gpu_carry.sh: $*" >&2; exit 2; }
LOCALE_SRC="${LOCALE_SRC:-/usr/share/locale}"
ls "$LOCALE_SRC"/de/LC_MESSAGES/*.mo >/dev/null 2>&1 || fail "no German catalogs in $LOCALE_SRC/de/LC_MESSAGES"
mkdir -p "$OUT/wheels" "$OUT/locale/de/LC_MESSAGES" "$OUT/peers"

# ------------------------------------------------------------------------------------------------ wheels
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/gpu_wheels.txt | grep -v '^$')
echo "== wheels: ${#PINS[@]} pinned in bench/gpu_wheels.txt"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT/wheels" "${PINS[@]}" 2>&1 \
  | grep -v "^WARNING: Location" || true
# one version of each (an older download left beside a new pin would stop the whole install there)
"$PY" - "$OUT/wheels" bench/gpu_image.txt "${PINS[@]}" <<'EOF'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

folder, image_file, pins = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
wanted = {canonicalize_name(Requirement(p).name): str(Requirement(p).specifier) for p in pins}
carried = {}
for whl in sorted(folder.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(whl.name)
    if name not in wanted or not Requirement(f"{name}{wanted[name]}").specifier.contains(version):
        whl.unlink()  # a version no longer pinned
        print(f"   removed {whl.name}: not pinned in bench/gpu_wheels.txt")
        continue
    carried[name] = whl
missing = sorted(set(wanted) - set(carried))
if missing:
    sys.exit(f"gpu_carry.sh: no wheel downloaded for {', '.join(missing)} (bench/gpu_wheels.txt)")
image = {canonicalize_name(line.strip()) for line in image_file.read_text(encoding="utf-8").splitlines()
         if line.strip() and not line.startswith("#")}
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
unmet = []
for name, whl in carried.items():
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(meta).decode("utf-8").splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env | {"extra": ""}):
            continue  # another platform's, an older Python's, or an extra's
        need = canonicalize_name(req.name)
        if need not in carried and need not in image:
            unmet.append(f"{whl.name} needs {req} (neither in bench/gpu_wheels.txt nor in {image_file})")
if unmet:
    sys.exit("gpu_carry.sh: " + "\n  ".join(["a carried wheel's need is missing on the device:", *unmet]))
print(f"   {len(carried)} wheels; every need of each is carried or in the device image")
EOF

# ------------------------------------------------------------------------------------------------ data, peer
cp -p "$LOCALE_SRC"/de/LC_MESSAGES/*.mo "$OUT/locale/de/LC_MESSAGES/"
echo "== locale: $(ls "$OUT"/locale/de/LC_MESSAGES/*.mo | wc -l) German catalogs"
if [ -f "$PEER" ]; then
  cp -p "$PEER" "$OUT/peers/peer_demo.py"
  echo "== peer: $PEER"
else
  rm -f "$OUT/peers/peer_demo.py"
  echo "== peer: none at $PEER (gpu_run.sh's base_peer step will say so)"
fi

# ------------------------------------------------------------------------------------------------ size
carry_bytes=$(du -sb "$OUT" | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (carry_bytes + tree_bytes + 1048575) / 1048576 ))
{
  echo "gpu_carry.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) for commit $(git rev-parse --short HEAD)"
  echo "carry $((carry_bytes / 1048576)) MiB + tracked tree $((tree_bytes / 1048576)) MiB = about $total_mib MiB"
  (cd "$OUT" && find . -type f ! -name MANIFEST.txt -printf '%s\t%p\n' | sort -k2)
} > "$OUT/MANIFEST.txt"
echo "== $OUT: $((carry_bytes / 1048576)) MiB, with the tracked tree about $total_mib MiB (limit $BUDGET)"
[ "$total_mib" -le "$BUDGET" ] || fail "$OUT and the tracked tree come to $total_mib MiB, over --budget-mib $BUDGET: drop a wheel from bench/gpu_wheels.txt"
echo "carry it: the device tool's run with carry [\"$OUT\"] and: bash bench/gpu_run.sh --carry $OUT --part 1"
