#!/bin/bash
# The GPU measurement in one command (docs/gpu.md; `make gpu-check`; the bundle's device
# command): the CUDA tests and the training-time ratios (python -m fromp_bench.gpu_check:
# split MNIST at 2 and at 15 epochs per task, split CIFAR's network at one epoch on synthetic
# files), then a profile of a training step of Naive, EWC and FROMP in their third experience
# (python -m studies.step_overhead --trace), records and logs under OUT. Run from the
# checkout's root:
#   bash studies/gpu_step.sh OUT [BUDGET_S]
# BUDGET_S (default 400) bounds the GPU check; the profile gets at most PROFILE_S (150) more.
# On the CPU, for a test: DEVICE=cpu QUICK=1 [CASES=...] [PROFILE_ARGS="..."] bash ... OUT 60
set -u
OUT=$1; BUDGET=${2:-400}; DEV=${DEVICE:-cuda}; PY=${PYTHON:-python3}
mkdir -p "$OUT"
CHECK=(--device "$DEV" --budget "$BUDGET" --out "$OUT")
[ -n "${QUICK:-}" ] && CHECK+=(--quick)
[ -n "${CASES:-}" ] && CHECK+=(--cases "$CASES")
$PY -m fromp_bench.gpu_check "${CHECK[@]}" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
STEM=$(date -u +%F)-$DEV
# shellcheck disable=SC2086  # PROFILE_ARGS: several words
timeout "${PROFILE_S:-150}" $PY -m studies.step_overhead --device "$DEV" --trace --no-plain \
  ${PROFILE_ARGS:-} --out "$OUT/$STEM-step-profile.json" 2>&1 | tee "$OUT/step_profile.log"
prc=${PIPESTATUS[0]}
echo "gpu_check exit $rc, step profile exit $prc"
[ "$rc" = 0 ] && [ "$prc" = 0 ]
