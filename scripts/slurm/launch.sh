#!/usr/bin/env bash
# Launch megatron_lc on a SLURM allocation: one srun task per node, each running pretrain_gpt.py as that node's
# launcher (--nproc-per-node ranks; megatron_lc/training/launcher.py). The launcher of node 0 (the first node of the
# allocation) hosts the rendezvous store, the others join it. Called by the .sbatch files next to this one:
#     launch.sh CONFIG.yaml [pretrain_gpt.py arguments, e.g. --set train.train_iters=100]
#
# Environment (all optional):
#   DRY_RUN=1          print the commands, check the config against the world size, run nothing
#   GPUS_PER_NODE      ranks per node; unset: SLURM_GPUS_ON_NODE (the GPUs allocated on the node), else, on nodes
#                      without GPUs, SLURM_NTASKS_PER_NODE (one CPU rank per task: sbatch --ntasks-per-node); none
#                      of them: an error. The log says which it was.
#   OMP_NUM_THREADS    threads per rank; default: SLURM_CPUS_ON_NODE / ranks per node, else 1
#   RUN_DIR            checkpoints, metrics.jsonl and per-node logs; default: runs/<job name>
#   MASTER_ADDR        node 0's address as the other nodes reach it; default: the first host of SLURM_JOB_NODELIST
#   MASTER_PORT        rendezvous port on node 0 (default 29500)
#   CONTAINER_IMAGE    run inside this image with pyxis/enroot (srun --container-image)
#   PYTHON             python that runs pretrain_gpt.py on the nodes and the dry run's config check (default python3)
#   SHUTDOWN_TIMEOUT   seconds each node's launcher waits for its ranks to save after a signal before SIGKILL
#                      (default 600)
#
# Stopping: SIGUSR1 to this shell (#SBATCH --signal=B:USR1@300: 5 min before the time limit) or SIGTERM (scancel,
# preemption) is forwarded to srun, which forwards it to every node's launcher, which forwards it to its ranks; the
# ranks agree on a step, save one checkpoint and exit 0, and so does every node.
# Requeueing: rank 0 ends the run by writing how it ended to RUN_DIR/checkpoints/run_outcome.txt, one line:
# "finished: ...", "stopped: ..." (unfinished, its checkpoint written) or "failed: <the error>". The job requeues
# itself (scontrol requeue; the requeued job resumes from RUN_DIR/checkpoints) only on "stopped", with srun's exit
# code 0 and no SIGTERM to this shell (scancel; a preempting scheduler with PreemptMode=REQUEUE requeues by itself).
# A failed run is not requeued and this script exits non-zero with its line.
set -uo pipefail

CONFIG=${1:?usage: launch.sh CONFIG.yaml [pretrain_gpt.py arguments]}
shift
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
NNODES=${SLURM_NNODES:-1}
JOB_ID=${SLURM_JOB_ID:-local}
RUN_DIR=${RUN_DIR:-$REPO/runs/${SLURM_JOB_NAME:-megatron_lc}}
MASTER_PORT=${MASTER_PORT:-29500}
PY=${PYTHON:-python3}
OUTCOME=$RUN_DIR/checkpoints/run_outcome.txt

fail() {  # a mistake in the environment: one line, exit 2, nothing run
    echo "error: $*" >&2
    exit 2
}

# ranks per node, and where the number came from: never guessed
if [[ -n ${GPUS_PER_NODE:-} ]]; then
    RANKS=$GPUS_PER_NODE RANKS_FROM="GPUS_PER_NODE"
elif [[ -n ${SLURM_GPUS_ON_NODE:-} && $SLURM_GPUS_ON_NODE != 0 ]]; then
    RANKS=$SLURM_GPUS_ON_NODE RANKS_FROM="SLURM_GPUS_ON_NODE: the GPUs allocated on the node"
elif [[ -n ${SLURM_NTASKS_PER_NODE:-} ]]; then
    RANKS=$SLURM_NTASKS_PER_NODE RANKS_FROM="SLURM_NTASKS_PER_NODE: no GPUs on the node, one CPU rank per task"
else
    fail "ranks per node unknown: none of GPUS_PER_NODE, SLURM_GPUS_ON_NODE, SLURM_NTASKS_PER_NODE is set" \
         "(outside an allocation, e.g. for a dry run, set GPUS_PER_NODE)"
fi
[[ $RANKS =~ ^[1-9][0-9]*$ ]] || fail "ranks per node must be a whole number >= 1, not '$RANKS' (${RANKS_FROM%%:*})"
WORLD=$((NNODES * RANKS))
if [[ -n ${OMP_NUM_THREADS:-} ]]; then
    THREADS_FROM="OMP_NUM_THREADS"
elif [[ ${SLURM_CPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ ]]; then
    OMP_NUM_THREADS=$((SLURM_CPUS_ON_NODE / RANKS > 0 ? SLURM_CPUS_ON_NODE / RANKS : 1))
    THREADS_FROM="SLURM_CPUS_ON_NODE=$SLURM_CPUS_ON_NODE / $RANKS ranks"
else
    OMP_NUM_THREADS=1 THREADS_FROM="no SLURM_CPUS_ON_NODE"
fi
export OMP_NUM_THREADS

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
MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}

export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a collective past parallel.distributed_timeout_minutes aborts the rank
# CUDA_DEVICE_MAX_CONNECTIONS: set by each rank where tensor-parallel overlap needs it (tp > 1:
# training/process_group.cuda_connections); with tp 1 it would serialise FSDP2's gathers behind long kernels

TRAIN=(--config "$CONFIG"
       --set "checkpoint.save=$RUN_DIR/checkpoints" --set "checkpoint.load=$RUN_DIR/checkpoints"
       --set "logging.metrics_file=$RUN_DIR/metrics.jsonl" "$@")
# the same command on every node; each adds its node rank, which srun sets per node (SLURM_NODEID)
NODE=("$PY" pretrain_gpt.py --nproc-per-node "$RANKS" --nnodes "$NNODES" --master-addr "$MASTER_ADDR"
      --master-port "$MASTER_PORT" --shutdown-grace "${SHUTDOWN_TIMEOUT:-600}" "${TRAIN[@]}")
# shellcheck disable=SC2016  # $@ and $SLURM_NODEID are expanded by the bash that srun starts on each node
PER_NODE=(bash -c 'exec "$@" --node-rank "$SLURM_NODEID"' node "${NODE[@]}")
SRUN=(srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 --chdir "$REPO"
      --output "$RUN_DIR/logs/${JOB_ID}_node%n.log" --open-mode append)
if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    SRUN+=(--container-image "$CONTAINER_IMAGE" --container-mounts "$REPO:$REPO,$RUN_DIR:$RUN_DIR"
           --container-workdir "$REPO")
fi
SAY="$NNODES node(s), ranks per node: $RANKS ($RANKS_FROM), world $WORLD, threads per rank: $OMP_NUM_THREADS"
SAY+=" ($THREADS_FROM), rendezvous $MASTER_ADDR:$MASTER_PORT"

if [[ -n ${DRY_RUN:-} && ${DRY_RUN} != 0 ]]; then
    echo "# job $JOB_ID: $SAY"
    echo "mkdir -p $RUN_DIR/logs"
    printf '%q ' "${SRUN[@]}" "${PER_NODE[@]}"; echo
    echo "# on SIGUSR1: kill -USR1 <srun pid>; wait; scontrol requeue $JOB_ID if $OUTCOME says stopped"
    cd "$REPO" && exec "$PY" - "$WORLD" "${TRAIN[@]}" <<'PY'
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
rm -f "$OUTCOME"  # the previous attempt's: only this run's own end may decide a requeue
GOT_TERM=0
SRUN_PID=
# shellcheck disable=SC2329  # invoked by the traps below
on_signal() {  # $1: signal name
    echo "$(date +%T) batch script got SIG$1: forwarding to srun ($SRUN_PID)"
    [[ $1 == TERM ]] && GOT_TERM=1
    [[ -n $SRUN_PID ]] && kill "-$1" "$SRUN_PID" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

echo "$(date +%T) job $JOB_ID: $SAY, run dir $RUN_DIR"
"${SRUN[@]}" "${PER_NODE[@]}" &
SRUN_PID=$!
rc=0
wait "$SRUN_PID" || rc=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait: wait again for the save to end
    rc=0
    wait "$SRUN_PID" || rc=$?
done
echo "$(date +%T) srun exited with $rc"

outcome=
[[ -f $OUTCOME ]] && IFS= read -r outcome < "$OUTCOME"
case $outcome in
    stopped:*)
        if [[ $rc != 0 ]]; then
            echo "$(date +%T) no requeue: srun exited with $rc, though the run says: $outcome"
        elif [[ $GOT_TERM == 1 ]]; then
            echo "$(date +%T) no requeue: this job got SIGTERM (scancel; a preempting scheduler with" \
                 "PreemptMode=REQUEUE requeues it by itself); the run says: $outcome"
        else
            echo "$(date +%T) requeue: $outcome"
            scontrol requeue "$JOB_ID" || { rc=$?; echo "error: scontrol requeue $JOB_ID failed (exit $rc):" \
                                                   "submit the job again to resume" >&2; }
        fi ;;
    finished:*)
        echo "$(date +%T) no requeue: $outcome" ;;
    failed:*)
        echo "$(date +%T) no requeue: $outcome"
        [[ $rc == 0 ]] && rc=1 ;;
    *)
        echo "$(date +%T) no requeue: the run did not say how it ended (no $OUTCOME: it did not reach its end," \
             "or checkpoint.save is elsewhere); see $RUN_DIR/logs/${JOB_ID}_node*.log" ;;
esac
exit "$rc"
