#!/usr/bin/env bash
# The GPU check: on a machine with one CUDA GPU, first times the attention kernels at the shipped layouts' calls
# (bench/attention_kernels.py, at most 7 minutes: the step time at 1M tokens is their speed) and writes the measured
# table into the GPU's hardware profile (configs/hardware/<gpu>.yaml, attention_measured: what attention_backend auto
# and the estimator read), then runs tests/gpu within 25 minutes, cheap tests first (T1 kernels vs
# fp64 and against SDPA at 32K, T2 parity on the device, async vs synchronised copies, byte accounting, T3 copies,
# several ranks on one GPU over gloo, T6 memory plan auto vs off, T4 a profiled 64K step, T5 the longest trainable
# sequence and MFU vs Hugging Face, which takes what is left of the time) and writes
#   bench/results/gpu_<gpu>_<date>_attention.json   the attention kernels' timings (+ _attention.log)
#   bench/results/gpu_<gpu>_<date>.json   every figure the tests recorded
#   bench/results/gpu_<gpu>_<date>.md     a short summary
#   bench/results/gpu_<gpu>_<date>.log    pytest's output
# Uses the machine's own python3 and torch (never reinstalls torch): the package is installed with --no-deps;
# carry wheels for what is missing (docs/gpu.md). Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
if ! "$PY" -c "import megatron_lc" 2>/dev/null; then
    "$PY" -m pip install --no-deps -q -e . || exit 1
fi
# every API the code calls, in one line, first; a missing one is said and the tests go on (they need a subset)
"$PY" tools/preflight.py || echo "warning: $PY lacks APIs the code calls (above); tests needing them will fail"
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_') if torch.cuda.is_available() else 'none')") || exit 1
if [ "$gpu" = "none" ]; then
    echo "error: no CUDA device visible to $PY (MEGATRON_LC_GPU_DRYRUN=1 $PY -m pytest tests/gpu runs the logic on CPU)" >&2
    exit 2
fi
stem="bench/results/gpu_${gpu}_$(date +%F)"
mkdir -p bench/results
# the biggest unknown first: which attention kernel this GPU runs fastest, and how fast (commit the profile after)
"$PY" bench/attention_kernels.py --write-profile --budget-s 420 --out "${stem}_attention.json" 2>&1 >/dev/null \
    | tee "${stem}_attention.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || echo "warning: bench/attention_kernels.py failed (${stem}_attention.log); the tests go on"
limit=1500  # 25 minutes; the tests pace themselves by GPU_CHECK_DEADLINE, a minute before it (T5 stops there)
GPU_CHECK_DEADLINE=$(($(date +%s) + limit - 60)) GPU_CHECK_OUT="$stem.json" timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$stem.log"
status=${PIPESTATUS[0]}
echo "wrote ${stem}_attention.json, $stem.json, $stem.md, $stem.log (pytest exit $status); commit them with the profile"
exit "$status"
