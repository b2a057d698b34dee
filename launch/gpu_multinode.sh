#!/usr/bin/env bash
# Multi-node GPU training without a scheduler: run this on every node (or once with
# --hosts to start it on all of them over ssh). Run with --help for usage.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

usage() {
  cat <<'EOF'
usage: launch/gpu_multinode.sh --workdir DIR --num_nodes N --node_rank R --coordinator HOST:PORT
                               [options] [-- --config.x=y ...]
       launch/gpu_multinode.sh --workdir DIR --hosts host0,host1,... [options] [-- ...]

Starts main.py for one node of an N-node job: one process seeing all local GPUs
(default), or --procs_per_node G processes with one GPU each. Process ids are
node_rank * procs_per_node + local_rank; the coordinator (process 0) listens on
HOST:PORT of node 0, which every node must reach. main.py sees
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID and calls
jax.distributed.initialize(); JAX_LOCAL_DEVICE_IDS selects each process's GPUs.

Before any process starts, the run's train step is compiled for the whole cluster on
this machine's CPU (`python -m odetransformer.memory --compile_for=h100xN` with the
venv's python; jax[cuda12] brings the compiler): a config that does not compile or fit
is refused in one line. With --hosts it runs once, here, before the nodes start.

With --hosts, this script ssh's to every host (passwordless ssh; the same checkout
path and venv on each), runs itself there with the right --node_rank (node 0 = the
first host = coordinator), prefixes and streams their logs, and stops all of them
when one fails. Run it again to resume: main.py restores the latest checkpoint in
WORKDIR, which must be shared by all nodes (NFS/Lustre) or a gs:// path.

options (flag, or the environment variable in brackets; default after '='):
  --config FILE         [CONFIG] = configs/owt_small.py
  --workdir DIR         shared checkpoint/log directory [WORKDIR] (required)
  --data_dir DIR        sets --config.data.data_dir [DATA_DIR] = (config's)
  --num_nodes N         [NUM_NODES] = 1
  --node_rank R         this node's index, 0 = coordinator [NODE_RANK] = 0
  --coordinator H:P     node 0's address:port [COORDINATOR] = localhost:12345
  --port P              port used with --hosts [COORD_PORT] = 12345
  --hosts LIST          comma-separated hosts, launch all over ssh [HOSTS]
  --procs_per_node G    1 = a process per node, G = a process per GPU [PROCS_PER_NODE] = 1
  --gpus_per_node G     GPUs per node [GPUS_PER_NODE] = nvidia-smi's count
  --venv DIR            virtualenv with jax[cuda12] [VENV] = .venv
  --setup               (re)install jax[cuda12] at requirements.txt's jax pin and
                        requirements.txt into the venv [SETUP=1]; without it this
                        happens only when the venv has no python. With a venv on a
                        shared disk, set it up once (one node, --setup) before --hosts
  --nccl_socket_if IF   NCCL_SOCKET_IFNAME, e.g. eth0 [NCCL_SOCKET_IFNAME]
  --nccl_ib_hca LIST    NCCL_IB_HCA, e.g. mlx5 [NCCL_IB_HCA]
  --preflight_target T  what the pre-flight compiles for [PREFLIGHT_TARGET] =
                        h100x<num_nodes x gpus_per_node> (the GPUs are H100s)
  --skip_preflight      do not compile the train step for the cluster first
                        (other GPUs than H100s) [SKIP_PREFLIGHT=1]
  --dry_run             print the commands instead of running them [DRY_RUN=1]
  -h, --help            this text
Everything after `--` (and any --config.* flag) is passed to main.py.

examples (2 nodes × 8 GPUs):
  node0$ launch/gpu_multinode.sh --num_nodes 2 --node_rank 0 --coordinator node0:12345 \
             --workdir /shared/runs/owt_small -- --config.mesh.shape=1,-1,1
  node1$ launch/gpu_multinode.sh --num_nodes 2 --node_rank 1 --coordinator node0:12345 \
             --workdir /shared/runs/owt_small -- --config.mesh.shape=1,-1,1
  or, from anywhere with ssh access:
  $ launch/gpu_multinode.sh --hosts node0,node1 --workdir /shared/runs/owt_small
EOF
}

CONFIG="${CONFIG:-configs/owt_small.py}"
WORKDIR="${WORKDIR:-}"
DATA_DIR="${DATA_DIR:-}"
NUM_NODES="${NUM_NODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
COORDINATOR="${COORDINATOR:-localhost:12345}"
COORD_PORT="${COORD_PORT:-12345}"
HOSTS="${HOSTS:-}"
PROCS_PER_NODE="${PROCS_PER_NODE:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-}"
VENV="${VENV:-.venv}"
SETUP="${SETUP:-0}"
DRY_RUN="${DRY_RUN:-0}"
PREFLIGHT_TARGET="${PREFLIGHT_TARGET:-}"
SKIP_PREFLIGHT="${SKIP_PREFLIGHT:-0}"
PROG=gpu_multinode.sh
OPTIONS=("${COMMON_OPTIONS[@]}" --num_nodes=NUM_NODES --node_rank=NODE_RANK
         --coordinator=COORDINATOR --port=COORD_PORT --hosts=HOSTS
         --procs_per_node=PROCS_PER_NODE --gpus_per_node=GPUS_PER_NODE --venv=VENV
         --setup=SETUP=1 --nccl_socket_if=+NCCL_SOCKET_IFNAME --nccl_ib_hca=+NCCL_IB_HCA
         --preflight_target=PREFLIGHT_TARGET --skip_preflight=SKIP_PREFLIGHT=1)
parse_args "$@"

require WORKDIR --workdir
for v in NUM_NODES NODE_RANK PROCS_PER_NODE COORD_PORT; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, got '${!v}'"
done
(( NUM_NODES >= 1 && PROCS_PER_NODE >= 1 )) || die "--num_nodes and --procs_per_node must be >= 1"

# ---------------------------------------------------------------------------------
# --hosts: start this script on every host over ssh and babysit them.
# ---------------------------------------------------------------------------------
if [[ -n "$HOSTS" ]]; then
  IFS=',' read -r -a HOST_LIST <<< "$HOSTS"
  n="${#HOST_LIST[@]}"
  coord="${HOST_LIST[0]}:$COORD_PORT"
  pass=(--config "$CONFIG" --workdir "$WORKDIR" --num_nodes "$n" --coordinator "$coord"
        --procs_per_node "$PROCS_PER_NODE" --venv "$VENV")
  [[ -n "$DATA_DIR" ]] && pass+=(--data_dir "$DATA_DIR")
  [[ -n "$GPUS_PER_NODE" ]] && pass+=(--gpus_per_node "$GPUS_PER_NODE")
  [[ "$SETUP" == 1 ]] && pass+=(--setup)
  [[ -n "${NCCL_SOCKET_IFNAME:-}" ]] && pass+=(--nccl_socket_if "$NCCL_SOCKET_IFNAME")
  [[ -n "${NCCL_IB_HCA:-}" ]] && pass+=(--nccl_ib_hca "$NCCL_IB_HCA")
  if [[ "$SKIP_PREFLIGHT" != 1 ]]; then  # once, here: the nodes skip it
    preflight "$ROOT" "${PREFLIGHT_TARGET:-h100x$((n * ${GPUS_PER_NODE:-8}))}" "$VENV/bin/python"
  fi
  pass+=(--skip_preflight)
  pids=()
  for rank in "${!HOST_LIST[@]}"; do
    host="${HOST_LIST[$rank]}"
    remote="$(printf '%q ' "$ROOT/launch/gpu_multinode.sh" "${pass[@]}" --node_rank "$rank" -- "${EXTRA[@]}")"
    if [[ "$DRY_RUN" == 1 ]]; then
      echo "+ ssh $host $remote"
      continue
    fi
    # -tt: closing the ssh session (when we stop) kills the remote processes.
    ssh -tt -o BatchMode=yes "$host" "$remote" 2>&1 | sed -u "s/^/[$host] /" &
    pids+=($!)
  done
  [[ "$DRY_RUN" == 1 ]] && exit 0
  # shellcheck disable=SC2317  # called by the trap
  cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
  trap cleanup EXIT INT TERM
  rc=0
  # Any node failing stops the others (their collectives would hang otherwise).
  while (( ${#pids[@]} > 0 )); do
    wait -n "${pids[@]}" || { rc=$?; echo "a node failed (rc $rc): stopping all" >&2; break; }
    alive=()
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    pids=("${alive[@]+"${alive[@]}"}")
  done
  exit "$rc"
fi

# ---------------------------------------------------------------------------------
# One node: PROCS_PER_NODE processes of main.py.
# ---------------------------------------------------------------------------------
(( NODE_RANK < NUM_NODES )) || die "--node_rank $NODE_RANK must be < --num_nodes $NUM_NODES"
if [[ -z "$GPUS_PER_NODE" ]]; then
  if [[ "$DRY_RUN" != 1 ]] && command -v nvidia-smi >/dev/null; then
    GPUS_PER_NODE="$(nvidia-smi --list-gpus | wc -l)"
  else
    GPUS_PER_NODE=8
  fi
fi
if (( PROCS_PER_NODE > 1 && PROCS_PER_NODE != GPUS_PER_NODE )); then
  die "--procs_per_node must be 1 or the number of GPUs ($GPUS_PER_NODE)"
fi

export JAX_COORDINATOR_ADDRESS="$COORDINATOR"
export JAX_NUM_PROCESSES=$((NUM_NODES * PROCS_PER_NODE))
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

main_py_args

cd "$ROOT"
if [[ "$SETUP" == 1 || ! -x "$VENV/bin/python" ]]; then
  install_venv "$ROOT" "$VENV" cuda12
fi
if [[ "$SKIP_PREFLIGHT" != 1 ]]; then
  preflight "$ROOT" "${PREFLIGHT_TARGET:-h100x$((NUM_NODES * GPUS_PER_NODE))}" "$VENV/bin/python"
fi
pids=()
for ((local_rank = 0; local_rank < PROCS_PER_NODE; local_rank++)); do
  pid_id=$((NODE_RANK * PROCS_PER_NODE + local_rank))
  if (( PROCS_PER_NODE == 1 )); then
    devices="$(seq -s, 0 $((GPUS_PER_NODE - 1)))"
  else
    devices="$local_rank"
  fi
  cmd=(env JAX_PROCESS_ID="$pid_id" JAX_LOCAL_DEVICE_IDS="$devices"
       "$VENV/bin/python" main.py "${MAIN_ARGS[@]}")
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+ JAX_COORDINATOR_ADDRESS=%q JAX_NUM_PROCESSES=%q' "$JAX_COORDINATOR_ADDRESS" "$JAX_NUM_PROCESSES"
    printf ' %q' "${cmd[@]}"; printf '\n'
    continue
  fi
  "${cmd[@]}" &
  pids+=($!)
done
[[ "$DRY_RUN" == 1 ]] && exit 0

trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' INT TERM
rc=0
for p in "${pids[@]}"; do
  wait "$p" || rc=$?
done
exit "$rc"
