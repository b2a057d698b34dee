#!/usr/bin/env bash
# GPT-2 small on one GPU: DiffEqFormer vs GPT at GPT-2 small size, one epoch of Wikipedia
# (configs/wikipedia_small.py), seeds 0..SEEDS-1, the analysis PNGs of seed 0's
# DiffEqFormer; everything it prints and draws lands in $OUT.
#
#   bash benchmarks/gpu/wikipedia_small.sh pack     # here, once: the data as one xz archive
#   bash benchmarks/gpu/wikipedia_small.sh prepare  # here, once: tokenizer + epoch count
#   bash benchmarks/gpu/wikipedia_small.sh          # there (the run tool, carry .whl, tmp_gpu)
#   TINY=1 bash benchmarks/gpu/wikipedia_small.sh   # here: the whole script at toy size, on CPU
#
# prepare: unpacks the archive at the $WORK path the GPU machine will use, trains the
# SentencePiece tokenizer and counts the epoch there (single_epoch --prepare_only), and
# keeps them in $STATE, so the GPU minutes go to training (the tokenizer cache is keyed
# by the files' paths, sizes and mtimes, which the archive fixes).
# pack: ../shared/data's wikipedia-2015 (train, valid, test, SHA256SUMS) and the extra
# held-out texts (WikiText-2 test, Tiny Shakespeare) into $PACK/wikipedia-2015.tar.xz
# (xz -9; the 64 MiB that travel with the checkout must hold it and the wheels).
# run: installs the carried wheels (.whl/*.whl, as ../shared/gpu/README.md), unpacks the
# archive into $WORK/data (checking SHA256SUMS), restores the small files of earlier calls
# from $STATE (default $PACK/state: scores, run keys, tokenizer, analysis PNGs; no
# checkpoints), runs `python -m benchmarks.single_epoch --config=configs/wikipedia_small.py
# --seeds=$SEEDS` under `timeout $BUDGET_S`, then copies the log, tables, PNGs and the new
# state to $OUT whatever the exit status.
#
# Several calls: a command may run 600 s and a seed of both models takes ~5 minutes, so
# train one seed per call: SEEDS=1, then SEEDS=2, then SEEDS=3, each call carrying the
# previous call's $OUT/state as $PACK/state. Earlier seeds are read back from their
# stored scores (the last line covers every seed); seed 0's analysis runs in the call that
# trains it. Keep the tree unchanged between the calls: the stored scores are reused only
# under the same code version and config (and the data unpacks to the same $WORK path).
set -euo pipefail
cd "$(dirname "$0")/../.."

TINY=${TINY:-0}
PACK=${PACK:-tmp_gpu/wikipedia_small}  # ignored by git (/tmp*/): carry tmp_gpu to the GPU machine
WORK=${WORK:-/tmp/wikipedia_small}
OUT=${OUT:-$WORK/out}
STATE=${STATE:-$PACK/state}
SHARED=${SHARED:-../shared/data}
BUDGET_S=${BUDGET_S:-560}            # under the run tool's 600 s, leaving time to copy
if [[ "$TINY" == 1 ]]; then
  ARCHIVE=$PACK/wikipedia-2015-tiny.tar.xz
  SEEDS=${SEEDS:-1}
else
  ARCHIVE=$PACK/wikipedia-2015.tar.xz
  SEEDS=${SEEDS:-1}
fi
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python

die() { echo "error: $1" >&2; exit 2; }

pack() {
  [[ -d "$SHARED/wikipedia-2015" ]] || die "$SHARED/wikipedia-2015 is missing; set SHARED=<the shared data dir>"
  mkdir -p "$PACK"
  local files=(wikipedia-2015/SHA256SUMS wikipedia-2015/valid.txt wikipedia-2015/test.txt
               wikitext-2/test.txt tinyshakespeare/input.txt)
  for f in "$SHARED"/wikipedia-2015/train-*.txt; do files+=("wikipedia-2015/${f##*/}"); done
  if [[ "$TINY" == 1 ]]; then            # a slice of each file (no SHA256SUMS: they differ)
    local tiny; tiny=$(mktemp -d)
    for f in "${files[@]}"; do
      [[ "$f" == */SHA256SUMS ]] && continue
      mkdir -p "$tiny/$(dirname "$f")"
      local n=30000; [[ "$f" == wikipedia-2015/train-* ]] || n=6000
      head -c "$n" "$SHARED/$f" > "$tiny/$f"
    done
    tar -C "$tiny" -cf - wikipedia-2015 wikitext-2 tinyshakespeare | xz -9 -T2 > "$ARCHIVE"
    rm -rf "$tiny"
  else
    tar -C "$SHARED" -cf - "${files[@]}" | xz -9 -T1 > "$ARCHIVE"
  fi
  echo "packed $ARCHIVE: $(du -m "$ARCHIVE" | cut -f1) MiB"
}

unpack() {
  rm -rf "$WORK/data" && mkdir -p "$WORK/data"
  xz -dc "$ARCHIVE" | tar -C "$WORK/data" -xf -
  if [[ -f "$WORK/data/wikipedia-2015/SHA256SUMS" ]]; then
    (cd "$WORK/data/wikipedia-2015" && sha256sum --quiet -c SHA256SUMS) || die "the unpacked data does not match SHA256SUMS; pack it again"
  fi
}

save_state() {   # the small files a later call needs: scores, run keys, tokenizer, analysis
  mkdir -p "$1"
  (cd "$WORK/runs" && find . \( -name '*.json' -o -path './cache/tokenizers/*' -o -path './analysis/*' \) \
     -not -path '*/checkpoints/*' -not -path '*/.save_owners/*' -not -path './cache/prepared/*' \
     -not -name '*.npz' -type f -print0 | xargs -0 -r cp --parents -t "$1")
}

if [[ "${1:-}" == pack ]]; then pack; exit 0; fi
[[ -f "$ARCHIVE" ]] || { [[ "$TINY" == 1 ]] && pack; } || die "$ARCHIVE is missing; run 'bash $0 pack' here first and carry $PACK"

mkdir -p "$OUT" "$WORK"
# The wheels are the GPU image's missing packages (not for a CPU dry run or the prepare step).
if [[ "$TINY" != 1 && "${1:-}" != prepare ]] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# One persistent compilation cache: the later seeds and the scorers reuse seed 0's programs
# (TINY=1: the caller's when it names one, e.g. the tests', which then reuse them too).
if [[ "$TINY" != 1 || -z "${JAX_COMPILATION_CACHE_DIR:-}" ]]; then
  export JAX_COMPILATION_CACHE_DIR=$WORK/jax_cache
fi
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

unpack
mkdir -p "$WORK/runs"
if [[ -d "$STATE" ]]; then cp -r "$STATE"/. "$WORK/runs"/; fi

{ date -u; command -v nvidia-smi > /dev/null && nvidia-smi -L; "$PY" -c "import jax; print(jax.__version__, jax.devices())"; } > "$OUT/device.txt" 2>&1 || true
texts=$WORK/data/wikitext-2/test.txt,$WORK/data/tinyshakespeare/input.txt
args=(--data_dir="$WORK/data/wikipedia-2015" --workdir="$WORK/runs" --seeds="$SEEDS"
      --eval_text="$texts")
if [[ "$TINY" == 1 ]]; then
  args+=(--config=configs/wikipedia_small.py:tiny --steps="${STEPS:-4}" --eval_every=2
         --spectra_grid=4 --lyapunov_tokens=8)
else
  args+=(--config=configs/wikipedia_small.py)
fi
if [[ "${1:-}" == prepare ]]; then
  "$PY" -m benchmarks.single_epoch "${args[@]}" --prepare_only 2> "$OUT/prepare.log"
  save_state "$STATE" && echo "state for the GPU calls: $STATE ($(du -sh "$STATE" | cut -f1))"
  exit 0
fi
echo "python -m benchmarks.single_epoch ${args[*]} $*" | tee "$OUT/command.txt"
status=0
timeout "$BUDGET_S" "$PY" -m benchmarks.single_epoch "${args[@]}" "$@" \
  > "$OUT/single_epoch.log" 2> "$OUT/train.log" || status=$?

# What comes back: the report, the tables and PNGs, and the state for the next call.
cp "$WORK"/runs/single_epoch.{md,json,png} "$OUT"/ 2> /dev/null || true
if [[ -d "$WORK/runs/analysis" ]]; then
  mkdir -p "$OUT/analysis"
  cp "$WORK"/runs/analysis/*.{png,json,html} "$OUT/analysis"/ 2> /dev/null || true
fi
save_state "$OUT/state"
tail -n 40 "$OUT/single_epoch.log"
if [[ $status != 0 ]]; then
  echo "single_epoch exited $status (124: over BUDGET_S=$BUDGET_S s); stderr tail:" >&2
  tail -n 20 "$OUT/train.log" >&2
fi
exit $status
