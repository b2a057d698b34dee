#!/usr/bin/env bash
# Train on a Cloud TPU VM slice (single- or multi-host), with a babysit loop that
# recreates a preempted slice and relaunches; training resumes from the workdir.
#
# Run `launch/tpu_pod.sh --help` for usage (prints it and touches no cloud API).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"
JAX_PIN="$(pinned_jax_version "$ROOT")"

usage() {
  cat <<'EOF'
usage: launch/tpu_pod.sh --name NAME --zone ZONE --workdir gs://BUCKET/RUN [options] [-- --config.x=y ...]

First, on this machine's CPU, compiles the run's train step for the slice (--accelerator;
v5e/v5litepod and v5p slices: `python -m odetransformer.memory --compile_for=TYPE`, which
needs `pip install -r requirements-compile.txt` here) and refuses in one line when it does
not compile or fit. Then creates (or reuses) the TPU VM slice NAME, copies this checkout to every worker,
installs a venv with jax[tpu] at the jax version requirements.txt pins, and
requirements.txt, then runs on --worker=all:
  python main.py --config=CONFIG --workdir=WORKDIR [--config.* overrides]
streaming the logs of every worker here. With --babysit, a preempted or failed
run is retried: the slice is recreated if it is gone (spot/preemptible capacity),
and main.py resumes from the latest checkpoint in WORKDIR.

WORKDIR must be visible to every worker and outlive the VMs: a gs:// path
(orbax writes there directly) or a shared disk (Filestore/NFS) mounted on all workers.
A worker-local /tmp path loses the checkpoints with the VM.

options (flag, or the environment variable in brackets; default after '='):
  --name NAME            TPU name [TPU_NAME]                         (required)
  --zone ZONE            e.g. us-central2-b [TPU_ZONE]               (required)
  --project PROJECT      GCP project [TPU_PROJECT] = gcloud's default
  --accelerator TYPE     e.g. v4-32, v5p-64, v5litepod-16 [TPU_TYPE] = v4-8
  --version VERSION      TPU VM runtime [TPU_VERSION] = tpu-ubuntu2204-base
  --spot                 create spot capacity [TPU_SPOT=1]
  --config FILE          config [CONFIG] = configs/owt_small.py
  --workdir DIR          gs://... or shared-disk path [WORKDIR]      (required)
  --data_dir DIR         sets --config.data.data_dir [DATA_DIR] = (config's)
  --code_dir DIR         where the code goes on the workers [CODE_DIR] = ~/odetransformer
  --repo URL             git clone URL instead of copying this checkout [REPO]
  --branch REF           branch/tag/commit with --repo [BRANCH] = main
  --jax_spec SPEC        pip spec [JAX_SPEC] = jax[tpu]==(requirements.txt's jax pin)
  --skip_setup           reuse the code and venv already on the workers [SKIP_SETUP=1]
  --skip_preflight       do not compile the train step for the slice first [SKIP_PREFLIGHT=1]
  --python PATH          the python of the pre-flight [PREFLIGHT_PYTHON] = .venv/bin/python
  --babysit              retry until main.py exits 0 [BABYSIT=1]
  --max_restarts N       give up after N retries [MAX_RESTARTS] = 100
  --retry_sleep S        seconds between retries [RETRY_SLEEP] = 60
  --delete_when_done     delete the slice after a successful run [DELETE_WHEN_DONE=1]
  --dry_run              print the gcloud commands instead of running them [DRY_RUN=1]
  -h, --help             this text
Everything after `--` (and any unknown --config.* flag) is passed to main.py.

examples:
  launch/tpu_pod.sh --name odet-v4-32 --zone us-central2-b --accelerator v4-32 \
      --config configs/owt_medium.py --workdir gs://my-bucket/owt_medium \
      --data_dir gs://my-bucket/owt_data --babysit -- --config.mesh.shape=1,-1,1
  tail the logs later: gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=0 \
      --command 'tail -f ~/odetransformer/train.log'
EOF
}

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
ACCELERATOR="${TPU_TYPE:-v4-8}"
VERSION="${TPU_VERSION:-tpu-ubuntu2204-base}"
SPOT="${TPU_SPOT:-0}"
CONFIG="${CONFIG:-configs/owt_small.py}"
WORKDIR="${WORKDIR:-}"
DATA_DIR="${DATA_DIR:-}"
CODE_DIR="${CODE_DIR:-~/odetransformer}"
REPO="${REPO:-}"
BRANCH="${BRANCH:-main}"
JAX_SPEC="${JAX_SPEC:-jax[tpu]==$JAX_PIN}"
SKIP_SETUP="${SKIP_SETUP:-0}"
SKIP_PREFLIGHT="${SKIP_PREFLIGHT:-0}"
PREFLIGHT_PYTHON="${PREFLIGHT_PYTHON:-.venv/bin/python}"
BABYSIT="${BABYSIT:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-100}"
RETRY_SLEEP="${RETRY_SLEEP:-60}"
DELETE_WHEN_DONE="${DELETE_WHEN_DONE:-0}"
DRY_RUN="${DRY_RUN:-0}"
PROG=tpu_pod.sh
OPTIONS=("${COMMON_OPTIONS[@]}" --name=NAME --zone=ZONE --project=PROJECT
         --accelerator=ACCELERATOR --version=VERSION --spot=SPOT=1 --code_dir=CODE_DIR
         --repo=REPO --branch=BRANCH --jax_spec=JAX_SPEC --skip_setup=SKIP_SETUP=1
         --skip_preflight=SKIP_PREFLIGHT=1 --python=PREFLIGHT_PYTHON
         --babysit=BABYSIT=1 --max_restarts=MAX_RESTARTS --retry_sleep=RETRY_SLEEP
         --delete_when_done=DELETE_WHEN_DONE=1)
parse_args "$@"

require NAME --name TPU_NAME
require ZONE --zone TPU_ZONE
require WORKDIR --workdir
case "$WORKDIR" in
  gs://*|/*) ;;
  *) die "--workdir must be a gs:// URL or an absolute shared-disk path, got '$WORKDIR'" ;;
esac
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max_restarts must be a number"
[[ "$RETRY_SLEEP" =~ ^[0-9]+$ ]] || die "--retry_sleep must be a number"

GCLOUD_TPU=(gcloud compute tpus tpu-vm)
LOC=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && LOC+=(--project "$PROJECT")

run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

ssh_all() {  # ssh_all 'command' : runs on every worker, logs streamed here
  run "${GCLOUD_TPU[@]}" ssh "$NAME" "${LOC[@]}" --worker=all --command "$1"
}

slice_state() {  # READY, PREEMPTED, CREATING, ... or NONE
  if [[ "$DRY_RUN" == 1 ]]; then echo READY; return; fi
  "${GCLOUD_TPU[@]}" describe "$NAME" "${LOC[@]}" --format='value(state)' 2>/dev/null || echo NONE
}

ensure_slice() {
  local state
  state="$(slice_state)"
  case "$state" in
    READY) echo "slice $NAME is READY" ;;
    NONE) ;;
    *) echo "slice $NAME is $state: deleting it"
       run "${GCLOUD_TPU[@]}" delete "$NAME" "${LOC[@]}" --quiet ;;
  esac
  if [[ "$state" != READY ]]; then
    local create=("${GCLOUD_TPU[@]}" create "$NAME" "${LOC[@]}"
                  --accelerator-type "$ACCELERATOR" --version "$VERSION")
    [[ "$SPOT" == 1 ]] && create+=(--spot)
    echo "creating slice $NAME ($ACCELERATOR)"
    run "${create[@]}"
    SETUP_DONE=0
  fi
}

SETUP_DONE="$SKIP_SETUP"
setup_workers() {
  [[ "$SETUP_DONE" == 1 ]] && return 0
  if [[ -n "$REPO" ]]; then
    ssh_all "set -e; if [ -d $CODE_DIR/.git ]; then git -C $CODE_DIR fetch -q origin && git -C $CODE_DIR checkout -q $(printf %q "$BRANCH") && git -C $CODE_DIR pull -q --ff-only || true; else git clone -q $(printf %q "$REPO") $CODE_DIR && git -C $CODE_DIR checkout -q $(printf %q "$BRANCH"); fi"
  else
    local tmpdir tarball
    tmpdir="$(mktemp -d -t odet_code.XXXXXX)"
    tarball="$tmpdir/odet_code.tar.gz"
    run tar -C "$ROOT" --exclude=.venv --exclude=.git --exclude='__pycache__' -czf "$tarball" .
    run "${GCLOUD_TPU[@]}" scp "$tarball" "$NAME:/tmp/odet_code.tar.gz" "${LOC[@]}" --worker=all
    rm -rf "$tmpdir"
    ssh_all "set -e; mkdir -p $CODE_DIR && tar -C $CODE_DIR -xzf /tmp/odet_code.tar.gz"
  fi
  ssh_all "set -e; cd $CODE_DIR && (test -x .venv/bin/python || python3 -m venv .venv) && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q $(printf %q "$JAX_SPEC") -r requirements.txt"
  SETUP_DONE=1
}

train_once() {
  main_py_args
  local quoted
  quoted="$(printf ' %q' "${MAIN_ARGS[@]}")"
  # Every worker runs the same command; JAX finds the other workers itself
  # (TPU_WORKER_HOSTNAMES -> main.py calls jax.distributed.initialize()).
  ssh_all "cd $CODE_DIR && .venv/bin/python main.py$quoted 2>&1 | tee -a train.log; exit \${PIPESTATUS[0]}"
}

if [[ "$SKIP_PREFLIGHT" != 1 ]]; then
  case "$ACCELERATOR" in
    v5e-*|v5litepod-*|v5p-*) preflight "$ROOT" "$ACCELERATOR" "$PREFLIGHT_PYTHON" ;;
    *) echo "pre-flight: no compile target for $ACCELERATOR (v5e, v5litepod, v5p); skipped" ;;
  esac
fi

attempt=0
while true; do
  ensure_slice
  setup_workers
  rc=0
  train_once || rc=$?
  if [[ "$rc" == 0 ]]; then
    echo "training finished (workdir $WORKDIR)"
    break
  fi
  if [[ "$BABYSIT" != 1 ]]; then
    echo "main.py failed (rc $rc); rerun with --babysit to retry automatically" >&2
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  if (( attempt > MAX_RESTARTS )); then
    echo "giving up after $MAX_RESTARTS restarts" >&2
    exit 1
  fi
  echo "run failed or was preempted (rc $rc): retry $attempt/$MAX_RESTARTS in ${RETRY_SLEEP}s;" \
       "main.py resumes from the latest checkpoint in $WORKDIR"
  sleep "$RETRY_SLEEP"
done

if [[ "$DELETE_WHEN_DONE" == 1 ]]; then
  run "${GCLOUD_TPU[@]}" delete "$NAME" "${LOC[@]}" --quiet
fi
