#!/usr/bin/env bash
# The speed targets on one GPU: our GPT and the DiffEqFormer against nanoGPT, side by side in one
# run, with the profile split; then the tests that touch the model on the GPU.
#
#   bash benchmarks/gpu/speed.sh pack          # here, once: nanoGPT's model.py into $PACK
#   bash benchmarks/gpu/speed.sh throughput    # there: the side-by-side table and profiles
#   bash benchmarks/gpu/speed.sh tests         # there: JAX_PLATFORMS=cuda pytest
#   TINY=1 bash benchmarks/gpu/speed.sh throughput   # here: the same script at toy size, CPU
#
# pack copies nanoGPT's model.py (a checkout of karpathy/nanoGPT, default
# ../shared/reference/nanogpt) into $PACK/nanogpt, which git ignores: it travels with the
# checkout (the run tool's carry) and is never committed. The GPU machine installs the
# carried wheels (.whl/*.whl, as the GPU README says) and writes logs to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

TINY=${TINY:-0}
PACK=${PACK:-tmp_gpu}
NANOGPT_SRC=${NANOGPT_SRC:-../shared/reference/nanogpt}
OUT=${OUT:-/tmp/speed_out}
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python

die() { echo "error: $1" >&2; exit 2; }

pack() {
  [[ -f "$NANOGPT_SRC/model.py" ]] || die "$NANOGPT_SRC holds no model.py; set NANOGPT_SRC=<a nanoGPT checkout>"
  mkdir -p "$PACK/nanogpt"
  cp "$NANOGPT_SRC/model.py" "$PACK/nanogpt/"
  echo "packed $PACK/nanogpt/model.py"
}

setup() {
  mkdir -p "$OUT"
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  { date -u; command -v nvidia-smi > /dev/null && nvidia-smi -L
    "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  } > "$OUT/device.txt" 2>&1 || true
}

throughput() {
  [[ -f "$PACK/nanogpt/model.py" ]] || { [[ "$TINY" == 1 ]] && pack; } || die "$PACK/nanogpt is missing; run 'bash $0 pack' here first and carry $PACK"
  local common=(--nanogpt="$PACK/nanogpt" --profile)
  if [[ "$TINY" == 1 ]]; then
    runs=("--preset=tiny --rounds=1 --batches=1,2 --profile_steps=2")
  else
    # The baseline's table: batch 16 with dots_saveable, 32 without remat; the authors' d_t 20
    # (owt-small) for the targets and the gpt2-small preset's d_t 96 for its bytes floor.
    # Now: plain causal rows (as nanoGPT trains) at 16 and 32 x 1024, remat none
    # (the layer loop unrolled on a GPU, model.layer_loop='auto'), then packed rows.
    runs=("--preset=owt-small --dtype=bfloat16 --seq_len=1024 --batches=16 --remat=none --rounds=5"
          "--preset=owt-small --dtype=bfloat16 --seq_len=1024 --batches=32 --remat=none --rounds=5"
          "--preset=owt-small --dtype=bfloat16 --seq_len=1024 --batches=16 --remat=none --rounds=5 --packed")
  fi
  local i=0
  for r in "${runs[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # each run's flags are words
    echo "python -m benchmarks.throughput $r ${common[*]}" | tee -a "$OUT/commands.txt"
    # shellcheck disable=SC2086
    "$PY" -m benchmarks.throughput $r "${common[@]}" > "$OUT/throughput_$i.log" 2> "$OUT/throughput_$i.err" || {
      echo "run $i failed:" >&2; tail -n 20 "$OUT/throughput_$i.err" >&2; }
    grep -E "train:|ratio|^profile .*step|copies per step|^--" "$OUT/throughput_$i.log" || true
  done
}

tests() {
  # The tests that touch the model, attention, train step and decode, run on the GPU.
  local files=(tests/test_model.py tests/test_attention.py tests/test_train.py
               tests/test_generate.py tests/test_reference.py tests/test_time_grid.py)
  # cpu too: jax.debug.callback (a test of dropout masks) runs its callback on a CPU device.
  # pytest's status is the step's (and the script's): a failing test fails the run.
  local status=0
  JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu} "$PY" -m pytest -q -rs -p no:cacheprovider "${files[@]}" \
    > "$OUT/pytest.log" 2>&1 || status=$?
  tail -n 30 "$OUT/pytest.log"
  return "$status"
}

case "${1:-}" in
  pack) pack ;;
  throughput) setup; throughput ;;
  tests) setup; tests ;;
  *) die "say what to run: pack, throughput or tests (see the head of $0)" ;;
esac
