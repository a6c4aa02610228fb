#!/usr/bin/env bash
# Run one fedmpi experiment on a workstation: 1 server rank + W worker ranks.
#
#   jobs/mpirun.sh CONFIG.toml [WORKERS] [fedmpi run options...]
#   jobs/mpirun.sh exp.toml 4 --set seed=1 -o runs/exp-s1.h5
#
# WORKERS defaults to the number of cores. Each worker gets cores/WORKERS torch threads
# (fedmpi picks that itself); the server mostly sleeps, so oversubscribing by that one
# rank is fine. As root, OpenMPI needs the two OMPI_ALLOW_RUN_AS_ROOT* variables.
# Sweeps: run a cell (resumed or skipped if its file exists) the same way with
#   mpirun -n 3 --oversubscribe --bind-to none fedmpi sweep s.toml --run-cell I
# SLURM clusters: jobs/slurm/*.sbatch (jobs/README.md).
set -euo pipefail
config=${1:?usage: jobs/mpirun.sh CONFIG.toml [WORKERS] [fedmpi run options...]}
shift
workers=${1:-$(nproc)}
[[ $# -gt 0 ]] && shift
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
exec mpirun -n $((workers + 1)) --oversubscribe --bind-to none fedmpi run "$config" "$@"
