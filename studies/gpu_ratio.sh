#!/bin/bash
# Split MNIST time ratios on a GPU machine without a package index (docs/gpu.md): Naive, EWC
# and FROMP of this checkout ("new"), then EWC and FROMP of an older tree ("old", when
# .gpu-bundle/old holds one: git archive COMMIT fromp strategies benchmarks | tar -x -C
# .gpu-bundle/old), the registry's settings with EPOCHS epochs per task, seed 0; after each
# run OUT/summary.json holds every finished run's per-task seconds and its time over Naive's.
# Run from the checkout's root after `make gpu-bundle` and the wheels' install:
#   bash studies/gpu_ratio.sh DEVICE EPOCHS OUT [runner arguments]
set -u
DEV=$1; EP=$2; OUT=$3; shift 3; EXTRA="$*"
R=$PWD; B=$R/.gpu-bundle
mkdir -p /tmp/names /tmp/old_names
ln -sfn $R/strategies /tmp/names/fromp_avalanche; ln -sfn $R/benchmarks /tmp/names/fromp_bench
ln -sfn $B/old/strategies /tmp/old_names/fromp_avalanche; ln -sfn $B/old/benchmarks /tmp/old_names/fromp_bench
NEW=$R:/tmp/names:/tmp/site:$B/stub
OLD=$B/old:/tmp/old_names:/tmp/site:$B/stub
summ() {
  PYTHONPATH=$NEW python3 - "$OUT" <<'PY'
import glob, json, sys
from fromp_bench.gpu_check import summarise_run
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/*/split-mnist/runs/*.json")):
    run = json.load(open(f))
    if not run.get("complete"):
        continue
    code = f.split("/")[-4]
    rows[f"{code}/{run['strategy']}"] = {**summarise_run(run), "code": run.get("code")}
naive = rows.get("new/naive")
for k, r in rows.items():
    if naive and naive["total_s"] > 0:
        r["over_naive"] = r["total_s"] / naive["total_s"]
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
for k, r in rows.items():
    print(k, f"total {r['total_s']:.1f} s", "per task", [round(s, 1) for s in r["per_task_s"]],
          f"acc {r['mean_accuracy']:.2f}", f"x naive {r.get('over_naive', float('nan')):.3f}")
PY
}
run() {  # code strategy
  local P=$NEW D=$R; [ "$1" = old ] && P=$OLD && D=$B/old  # -m puts the cwd first on sys.path
  cd $D && PYTHONPATH=$P python3 -m fromp_bench split-mnist --strategies $2 --seeds 1 --device $DEV \
    --epochs $EP --no-progress --out $OUT/$1 $EXTRA > $OUT/$1-$2.log 2>&1 || echo "FAILED $1 $2"
  grep -h "fromp/continual/ewc.py\|^code" $OUT/$1-$2.log | head -2
  cd $R; summ
}
nvidia-smi -L 2>/dev/null
for s in naive ewc fromp; do run new $s; done
[ -d $B/old/fromp ] && for s in ewc fromp; do run old $s; done
