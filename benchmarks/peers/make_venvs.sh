#!/bin/bash
# Make one virtual environment per peer simulator, beside fedmpi's own, with the same
# torch as fedmpi (2.14.1; from this machine's wheels where PIP_FIND_LINKS points):
#   benchmarks/peers/.venvs/pfl     pfl-research 0.6.0 (Apple's pfl, PyTorch backend)
#   benchmarks/peers/.venvs/flower  Flower 1.42.0 with its Ray simulation engine
# Usage: bash benchmarks/peers/make_venvs.sh [pfl] [flower]   (both by default)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
torch_pins=(torch==2.14.1 torchvision==0.29.1)
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(pfl flower)
for name in "${want[@]}"; do
  case "$name" in
    pfl) pkgs=("pfl[pytorch]==0.6.0") ;;
    flower) pkgs=("flwr[simulation]==1.42.0") ;;
    *) echo "make_venvs.sh: unknown peer '$name' (allowed: pfl, flower)" >&2; exit 2 ;;
  esac
  venv="$here/.venvs/$name"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/pip" install -q "${torch_pins[@]}"
  # the peer on top, without letting it move torch
  "$venv/bin/pip" install -q "${pkgs[@]}" "${torch_pins[@]}" "numpy<3"
  "$venv/bin/python" -c "import torch; print('$name: torch', torch.__version__)"
done
