#!/usr/bin/env bash
# Run one fedmpi experiment on a workstation: 1 server rank + W worker ranks.
#
#   jobs/mpirun.sh CONFIG.toml [WORKERS] [fedmpi run options...]
#   jobs/mpirun.sh exp.toml 4 --set seed=1 -o runs/exp-s1.h5
#
# WORKERS defaults to the number of cores, also when the options follow CONFIG at once.
# Each worker gets cores/WORKERS torch threads (fedmpi picks that itself); the server
# mostly sleeps, so oversubscribing by that one rank is fine. As root, OpenMPI needs the
# two OMPI_ALLOW_RUN_AS_ROOT* variables.
#
# Stopping: `kill <this script>` (TERM), Ctrl-C (INT) or a closed terminal (HUP) become
# USR1 for mpirun, which passes USR1 to every rank: the run finishes its round,
# checkpoints, marks the file interrupted and exits 75; `fedmpi run --resume FILE`
# continues it. A second TERM/INT stops at once. (mpirun itself answers TERM/INT/HUP by
# killing the ranks within half a second, too soon for a checkpoint.)
#
# Sweeps: run a cell (resumed or skipped if its file exists) the same way with
#   mpirun -n 3 --oversubscribe --bind-to none fedmpi sweep s.toml --run-cell I
# SLURM clusters: jobs/slurm/*.sbatch (jobs/README.md).
set -euo pipefail
config=${1:?usage: jobs/mpirun.sh CONFIG.toml [WORKERS] [fedmpi run options...]}
shift
workers=$(nproc)
if [[ $# -gt 0 && $1 != -* ]]; then   # WORKERS given; an option (-o, --set) means it was not
  if [[ ! $1 =~ ^[0-9]+$ ]] || (( 10#$1 < 1 )); then
    echo "jobs/mpirun.sh: WORKERS=$1: must be a whole number >= 1 (worker ranks beside the server)" >&2
    exit 2
  fi
  workers=$((10#$1))
  shift
fi
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# In the background, so that this shell runs its traps at once (bash runs them only
# between commands), and in a session of its own, so that a Ctrl-C at the terminal
# reaches this shell only and not mpirun, which would kill the ranks.
setsid mpirun -n $((workers + 1)) --oversubscribe --bind-to none fedmpi run "$config" "$@" &
launcher=$!
stops=0
stop() {
  stops=$((stops + 1))
  if (( stops == 1 )); then
    echo "jobs/mpirun.sh: stopping after this round (checkpoint, exit 75); signal again to stop now" >&2
    kill -USR1 "$launcher" 2>/dev/null || true
  else
    kill -TERM "$launcher" 2>/dev/null || true
  fi
}
trap stop TERM INT HUP
# `wait` returns early when a trapped signal arrives: wait again until mpirun is done
set +e
while wait "$launcher"; rc=$?; kill -0 "$launcher" 2>/dev/null; do :; done
(( rc > 128 )) && { wait "$launcher"; rc=$?; }
exit "$rc"
