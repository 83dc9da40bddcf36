#!/bin/bash
# The user scenarios (studies.user_scenarios) on a GPU machine without a package
# index (docs/gpu.md), after `make gpu-bundle` and the wheels' install into /tmp/site:
#   bash studies/gpu_user_scenarios.sh OUT [CAP_SECONDS] [GROUPS: "ci bn cost"]
# The accuracy cases run side by side, one process per configuration (their seconds are then
# not comparable); the cost case runs alone afterwards, so that its timings are not shared.
# OUT/user_scenarios.json holds every case, OUT/user_scenarios.log every process's output.
set -u
OUT=$1; CAP=${2:-300}; GROUPS_=${3:-ci bn cost}
has() { [[ " $GROUPS_ " == *" $1 "* ]]; }
R=$PWD; T=$(mktemp -d)
mkdir -p /tmp/names
ln -sfn $R/strategies /tmp/names/fromp_avalanche; ln -sfn $R/benchmarks /tmp/names/fromp_bench
export PYTHONPATH=$R:/tmp/names:/tmp/site:$R/.gpu-bundle/stub PYTHONUNBUFFERED=1
D=${FROMP_DATA:-$R/.gpu-bundle/data}
M="python3 -m studies.user_scenarios --device cuda --data-root $D"
# Avalanche's SplitMNIST reads torchvision's extracted files; the bundle holds the .gz ones
for f in $D/MNIST/raw/*.gz; do [ -e "${f%.gz}" ] || gunzip -kf "$f"; done
has ci && for c in naive lwf replay-200 replay-1000 fromp-defaults fromp-200 fromp-recipe; do
  timeout $CAP $M --cases ci --only ci/$c --out $T/ci-$c.json > $T/ci-$c.log 2>&1 &
done
has bn && for m in slimresnet18 resnet18; do
  timeout $CAP $M --cases bn --only bn/$m/naive bn/$m/fromp-defaults --out $T/bn-$m.json > $T/bn-$m.log 2>&1 &
done
wait
has cost && timeout $CAP $M --cases cost --out $T/cost.json > $T/cost.log 2>&1
python3 - "$T" "$OUT" <<'PY'
import glob, json, sys
t, out = sys.argv[1], sys.argv[2]
merged = {"cases": {}, "records": []}
for f in sorted(glob.glob(f"{t}/*.json")):
    rec = json.load(open(f))
    merged["cases"].update(rec.pop("cases"))
    merged["records"].append(rec)  # each process's command, environment and protocol
json.dump(merged, open(f"{out}/user_scenarios.json", "w"), indent=1)
for name, case in merged["cases"].items():
    print(name, case["status"], case.get("mean_accuracy", case.get("after_experience_over_epoch")))
PY
tail -n 40 $T/*.log > $OUT/user_scenarios.log
