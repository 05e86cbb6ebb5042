#!/usr/bin/env bash
# Launch megatron_lc on a SLURM allocation: one srun task per node, each running torchrun over the node's GPUs,
# rendezvous (c10d) on the first node of the allocation. Called by the .sbatch files next to this one:
#     launch.sh CONFIG.yaml [pretrain_gpt.py arguments, e.g. --set train.train_iters=100]
#
# Environment (all optional):
#   DRY_RUN=1          print the commands, check the config against the world size, run nothing
#   GPUS_PER_NODE      default: SLURM_GPUS_ON_NODE, else 8
#   RUN_DIR            checkpoints, metrics.jsonl and per-node logs; default: runs/<job name>
#   MASTER_PORT        rendezvous port on the first node (default 29500)
#   CONTAINER_IMAGE    run inside this image with pyxis/enroot (srun --container-image)
#   PYTHON             python used for the dry-run config check (default python3)
#   SHUTDOWN_TIMEOUT   seconds torchrun waits for workers to save after a signal before SIGKILL (default 600)
#
# Faults: SIGUSR1 to this shell (#SBATCH --signal=B:USR1@300: 5 min before the time limit) is forwarded to srun,
# which forwards it to the torchrun agents, which forward it to the workers (PET_SIGNALS_TO_HANDLE); the workers
# agree on a step, save a checkpoint and exit 0; this script then requeues the job (scontrol requeue), and the
# requeued job resumes from RUN_DIR/checkpoints. SIGTERM (scancel, or preemption) is forwarded the same way but
# does not requeue here (a preempting scheduler with PreemptMode=REQUEUE requeues by itself).
set -uo pipefail

CONFIG=${1:?usage: launch.sh CONFIG.yaml [pretrain_gpt.py arguments]}
shift
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
NNODES=${SLURM_NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
JOB_ID=${SLURM_JOB_ID:-local}
RUN_DIR=${RUN_DIR:-$REPO/runs/${SLURM_JOB_NAME:-megatron_lc}}
MASTER_PORT=${MASTER_PORT:-29500}
WORLD=$((NNODES * GPUS_PER_NODE))

first_host() {  # first host of a SLURM node list: "gpu[007-009,012],cpu1" -> gpu007 (when scontrol is absent)
    local list=$1 head=${1%%,*}
    if [[ $head == *"["* ]]; then
        local inner=${list#*[}
        inner=${inner%%]*}; inner=${inner%%,*}; inner=${inner%%-*}
        echo "${list%%[*}${inner}"
    else
        echo "$head"
    fi
}

if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    if command -v scontrol >/dev/null 2>&1; then
        HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        HEAD_NODE=$(first_host "$SLURM_JOB_NODELIST")
    fi
else
    HEAD_NODE=$(hostname)
fi

# torchrun forwards these signals to its workers and waits SHUTDOWN_TIMEOUT s for them (env form: accepted by
# torchrun versions with and without the --signals-to-handle / --shutdown-timeout flags)
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
export PET_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$PET_SHUTDOWN_TIMEOUT
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a collective past parallel.distributed_timeout_minutes aborts the rank
export CUDA_DEVICE_MAX_CONNECTIONS=1       # kernel order = launch order (TP/SP communication overlap)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

TRAIN=(pretrain_gpt.py --config "$CONFIG"
       --set "checkpoint.save=$RUN_DIR/checkpoints" --set "checkpoint.load=$RUN_DIR/checkpoints"
       --set "logging.metrics_file=$RUN_DIR/metrics.jsonl" "$@")
TORCHRUN=(torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
          --rdzv-endpoint "$HEAD_NODE:$MASTER_PORT" --rdzv-id "$JOB_ID" --max-restarts 0 "${TRAIN[@]}")
SRUN=(srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 --chdir "$REPO"
      --output "$RUN_DIR/logs/${JOB_ID}_node%n.log")
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    SRUN+=(--container-image "$CONTAINER_IMAGE" --container-mounts "$REPO:$REPO,$RUN_DIR:$RUN_DIR"
           --container-workdir "$REPO")
fi

if [[ -n ${DRY_RUN:-} && ${DRY_RUN} != 0 ]]; then
    echo "# job $JOB_ID: $NNODES node(s) x $GPUS_PER_NODE GPUs = $WORLD ranks, rendezvous $HEAD_NODE:$MASTER_PORT"
    echo "mkdir -p $RUN_DIR/logs"
    printf '%q ' "${SRUN[@]}" "${TORCHRUN[@]}"; echo
    echo "# on SIGUSR1: kill -USR1 <srun pid>; wait; scontrol requeue $JOB_ID"
    cd "$REPO" && exec "${PYTHON:-python3}" - "$WORLD" "${TRAIN[@]:1}" <<'PY'
import sys
sys.path.insert(0, ".")
from pretrain_gpt import parse_args
from megatron_lc.config import ConfigError, load_config, resolve_layout
world, args = int(sys.argv[1]), parse_args(sys.argv[2:])
try:
    cfg = load_config(args.config, args.overrides)
    layout = resolve_layout(cfg, world)
except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
print(f"# config {args.config}: world {world} = tp {layout.tp} x cp {layout.cp} ({layout.cp_comm_type}) x dp "
      f"{layout.dp}; seq_length {layout.seq_length}, global batch {layout.global_batch_size}")
PY
fi

mkdir -p "$RUN_DIR/logs"
REQUEUE=0
SRUN_PID=
# shellcheck disable=SC2329  # invoked by the traps below
on_signal() {  # $1: signal name
    echo "$(date +%T) batch script got SIG$1: forwarding to srun ($SRUN_PID)"
    [[ $1 == USR1 ]] && REQUEUE=1
    [[ -n $SRUN_PID ]] && kill "-$1" "$SRUN_PID" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

echo "$(date +%T) job $JOB_ID: $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$MASTER_PORT, run dir $RUN_DIR"
"${SRUN[@]}" "${TORCHRUN[@]}" &
SRUN_PID=$!
rc=0
wait "$SRUN_PID" || rc=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait: wait again for the save to end
    rc=0
    wait "$SRUN_PID" || rc=$?
done
echo "$(date +%T) srun exited with $rc"
if [[ $REQUEUE == 1 ]]; then
    echo "$(date +%T) requeueing job $JOB_ID; it resumes from $RUN_DIR/checkpoints"
    scontrol requeue "$JOB_ID"
fi
exit "$rc"
