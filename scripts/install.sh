#!/usr/bin/env bash
# Make a virtual environment (.venv) with what running psar needs, and psar itself.
#
#   ./scripts/install.sh          # run psar: torch, gRPC, protobuf, prometheus-client, ...
#   ./scripts/install.sh --dev    # and what the tests need (pytest, hypothesis, ruff, ...)
#   ./scripts/install.sh --plots  # and matplotlib, for psar report's / psar compare's plots
#
# torch: a torch that already imports in the environment is kept (a GPU user's CUDA build
# stays). Otherwise, where `nvidia-smi -L` lists a GPU, PyPI's torch (a CUDA build); where
# none does, torch's CPU-only wheels from PSAR_TORCH_INDEX (default: PyTorch's CPU index),
# about 200 MB instead of several GB of CUDA libraries. PSAR_TORCH_INDEX= (empty) asks pip
# as it is configured (a mirror, or a wheel cache that already holds a CPU build).
#
# PYTHON picks the interpreter (default python3; psar needs 3.11 or newer); VENV the
# environment's folder (default .venv). Run from anywhere: paths are the checkout's.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${PSAR_TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${PSAR_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
extras=()
for arg in "$@"; do
  case "$arg" in
    --dev) extras+=(dev) ;;
    --plots) extras+=(plots) ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (accepted: --dev, --plots)" >&2; exit 2 ;;
  esac
done

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "install.sh: psar needs Python 3.11 or newer; $PY is $("$PY" -V 2>&1) (set PYTHON=...)" >&2
  exit 2
}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "install.sh: keeping torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "install.sh: a GPU is here: $TORCH_SPEC from PyPI (a CUDA build)"
  "${pip[@]}" "$TORCH_SPEC"
elif [ -n "$TORCH_INDEX" ]; then
  echo "install.sh: no GPU: $TORCH_SPEC, CPU-only, from $TORCH_INDEX"
  "${pip[@]}" "$TORCH_SPEC" --index-url "$TORCH_INDEX"
else
  echo "install.sh: no GPU: $TORCH_SPEC as pip is configured (PSAR_TORCH_INDEX is empty)"
  "${pip[@]}" "$TORCH_SPEC"
fi

target="."
if [ ${#extras[@]} -gt 0 ]; then
  target=".[$(IFS=,; echo "${extras[*]}")]"
fi
# torch is installed already and satisfies pyproject's range: pip adds nothing of CUDA.
"${pip[@]}" -e "$target"
if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
  echo "install.sh: note: CUDA libraries are installed in $VENV (nvidia-* packages)"
fi
echo "install.sh: ready: . $VENV/bin/activate && psar --help"
