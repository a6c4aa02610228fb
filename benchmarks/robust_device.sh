#!/usr/bin/env bash
# Robust aggregation with its blocks on the worker's GPU, in one device session (a few
# minutes on one GPU): the device tests, the sharded rule against the gather-on-rank-0
# reference bit for bit at 3 ranks, then seconds a round and peak memory at ResNet-18 size,
# the blocks on the CPU against the GPU, beside FedAvg's Reduce (docs/robustness.md).
#   bash benchmarks/robust_device.sh [cuda]     (PARAMS=100000 for a quick look)
set -euo pipefail
cd "$(dirname "$0")/.."
device="${1:-cuda}"
params="${PARAMS:-11200000}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
FEDMPI_TEST_DEVICE="$device" python -m pytest -q -n 0 tests/test_cuda.py -k robust
for rule in median trimmed_mean bulyan krum; do
  mpirun -n 3 --oversubscribe python benchmarks/robust.py --mode reduce --rule "$rule" \
    --params 1000000 --clients 20 --f 4 --repeat 1 --check --device "$device" > /dev/null
  echo "check $rule: the sharded rule on $device is the gathered reference, bit for bit"
done
summary='import json, sys; r = json.load(sys.stdin)
print(r["clients"], r["mode"], r["rule"], round(r["seconds"], 2), round(r["peak_mb_rank0"]),
      round(r["peak_mb_worker_max"]), sep="\t")'
echo -e "blocks on\tK\tmode\trule\tseconds\trank 0 MB\tworker MB"
for k in 20 100; do
  for where in cpu "$device"; do
    for spec in "reduce median" "sharded median" "sharded trimmed_mean" "sharded bulyan" \
                "sharded krum" "gather median"; do
      set -- $spec
      echo -ne "$where\t"
      mpirun -n 3 --oversubscribe python benchmarks/robust.py --mode "$1" --rule "$2" \
        --params "$params" --clients "$k" --f 4 --repeat 2 --device "$where" | python -c "$summary"
    done
  done
done
