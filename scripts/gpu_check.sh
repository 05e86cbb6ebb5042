#!/usr/bin/env bash
# The GPU check, sized for a loan of one GPU for 15 minutes (start included): at most 9 minutes, four parts in order
# of value, each under its time budget, each writing its result file as soon as it ends (a check the loan cuts off
# still returns what it measured), with the machine's own python3 and torch (never reinstalled; what that torch lacks
# is said by preflight in one line and skipped by the parts, never a crash of the check):
#   1 preflight  every API the code calls (tools/preflight.py), one line
#   2 kernels    the attention kernels at the shipped layouts' calls, every backend this GPU runs
#                (bench/attention_kernels.py --write-profile: the measured table into the GPU's hardware profile)
#   3 step       two training steps of Llama3-8B cut to 4 layers at the longest sequence the estimator says one GPU
#                holds within a 45 s step, the measured peak beside the estimator's and the rehearsal's
#                (bench/gpu_step.py; the rehearsal runs on the CPUs from the start, beside parts 1-2)
#   4 tests      tests/gpu's kernels vs fp64 (T1), the kernels' own workspaces vs device/kernel_scratch.py (T7),
#                parity on the device (T2), copies (T3)
# Files: bench/results/gpu_<gpu>_<date>_<part>.json (+ .log), _plan.json first; then commit them and the profile.
# MEGATRON_LC_GPU_DRYRUN=1 walks the same plan on the CPU (small shapes, CPU kernels, nothing timed), writing every
# file. The last line: "plan: N parts, budgets total T s". Exit status: 0, or 1 when a part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DRY=${MEGATRON_LC_GPU_DRYRUN:-0}
if ! "$PY" -c "import megatron_lc" 2>/dev/null; then
    "$PY" -m pip install --no-deps -q -e . || exit 1
fi
PARTS=(preflight kernels step tests)
declare -A BUDGET=([preflight]=45 [kernels]=180 [step]=150 [tests]=140)
total=0
for p in "${PARTS[@]}"; do total=$((total + BUDGET[$p])); done
# the dry run gives each part 4x its budget (a busy CPU machine walks the same plan slower than a GPU machine)
SLOW=1
[ "$DRY" = "1" ] && SLOW=4

if [ "$DRY" = "1" ]; then
    gpu=dryrun_cpu mem=80
else
    read -r mem gpu < <("$PY" -c "import torch; ok = torch.cuda.is_available(); \
print(torch.cuda.get_device_properties(0).total_memory / 2**30 if ok else 0, \
torch.cuda.get_device_name(0).replace(' ', '_') if ok else 'none')") || exit 1
    if [ "${gpu:-none}" = "none" ]; then
        echo "error: no CUDA device visible to $PY (MEGATRON_LC_GPU_DRYRUN=1 walks the plan on the CPU)" >&2
        exit 2
    fi
fi
stem="bench/results/gpu_${gpu}_$(date +%F)"
mkdir -p bench/results
"$PY" - "$stem" "$DRY" "$total" "${PARTS[@]}" <<'EOF' || exit 1
import json, sys
stem, dry, total, parts = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
with open(f"{stem}_plan.json", "w") as f:
    json.dump({"dryrun": dry, "parts": parts, "budgets_total_s": total}, f, indent=1)
EOF

failed=0
# part: NAME FILE CMD...: CMD under the part's budget; FILE (the part's result) written whatever happens
part() {
    local name=$1 file=$2
    shift 2
    echo "part $name: budget ${BUDGET[$name]} s -> $file"
    local t0=$SECONDS
    timeout --kill-after=5 $((BUDGET[$name] * SLOW)) "$@" > "${stem}_${name}.log" 2>&1
    local rc=$? took=$((SECONDS - t0))
    "$PY" - "$file" "$name" "$rc" "$took" $((BUDGET[$name] * SLOW)) "${stem}_${name}.log" <<'EOF'
import json, os, sys
file, name, rc, took, budget, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
with open(log, errors="replace") as f:
    tail = f.read().strip().splitlines()[-3:]
status = {"part": name, "returncode": rc, "timed_out": rc in (124, 137), "seconds": took, "budget_s": budget,
          "log_tail": tail}
data = {}
if os.path.exists(file):
    try:
        with open(file) as f:
            data = json.load(f)
    except ValueError:
        data = {"unreadable": open(file, errors="replace").read()[-500:]}
if not isinstance(data, dict):
    data = {"result": data}
data["check"] = status
with open(file, "w") as f:
    json.dump(data, f, indent=1, default=str)
print(f"part {name}: {'ran out of its budget' if status['timed_out'] else 'exit ' + str(rc)} in {took} s")
EOF
    [ "$rc" -eq 0 ] || failed=1
}

# preflight, then the step's plan (the estimator's pick); the step's rehearsal then runs on the CPUs while the GPU
# times kernels (it needs no GPU), in its own process group (its rank processes end with it)
part preflight "${stem}_preflight.json" bash -c "\"\$0\" tools/preflight.py --json \"\$1_preflight.json\"; \
\"\$0\" bench/gpu_step.py pick --gpu \"\$2\" --memory-gib \"\$3\" --out \"\$1_step_plan.json\" > /dev/null" \
    "$PY" "$stem" "${gpu//_/ }" "$mem"
setsid "$PY" bench/gpu_step.py rehearse --plan "${stem}_step_plan.json" --out "${stem}_step_rehearsal.json" \
    > "${stem}_step_rehearsal.log" 2>&1 &
rehearsal=$!
if [ "$DRY" = "1" ]; then
    part kernels "${stem}_kernels.json" "$PY" bench/attention_kernels.py --dry-run --out "${stem}_kernels.json"
else
    part kernels "${stem}_kernels.json" "$PY" bench/attention_kernels.py --write-profile --repeats 2 \
        --budget-s $((BUDGET[kernels] - 30)) --out "${stem}_kernels.json"
fi
# the rehearsal may take up to 60 s more, out of the step's own budget; then the step goes on without it
t0=$SECONDS
while [ $((SECONDS - t0)) -lt $((60 * SLOW)) ] && kill -0 "$rehearsal" 2>/dev/null; do sleep 1; done
kill -- -"$rehearsal" 2>/dev/null
BUDGET[step]=$((BUDGET[step] - (SECONDS - t0) / SLOW))
part step "${stem}_step.json" "$PY" bench/gpu_step.py measure --plan "${stem}_step_plan.json" \
    --rehearsal "${stem}_step_rehearsal.json" --out "${stem}_step.json"
export GPU_CHECK_DEADLINE=$(($(date +%s) + BUDGET[tests] * SLOW - 10)) GPU_CHECK_OUT="${stem}_tests.json"
part tests "${stem}_tests.json" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_t1_backend.py \
    tests/gpu/test_t7_scratch.py tests/gpu/test_t2_parity.py tests/gpu/test_t3_copies.py

echo "wrote ${stem}_{plan,preflight,kernels,step_plan,step_rehearsal,step,tests}.json (+ .log)"
echo "plan: ${#PARTS[@]} parts, budgets total ${total} s"
exit "$failed"
