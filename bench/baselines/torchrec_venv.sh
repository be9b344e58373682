#!/usr/bin/env bash
# Build the TorchRec venv bench/sparse.py's torchrec way runs in (issue #46 item 4).
#
# Why a venv of its own: fbgemm-gpu-cpu is built against one torch release and fails to
# load against another (fbgemm-gpu-cpu 1.9.0 on torch 2.13.0+cpu: an undefined symbol in
# fbgemm_gpu_tbe_index_select.so), and torchrec's own requirement is the CUDA build
# `fbgemm-gpu`. The pairing that loads and trains on CPU here: torch 2.13.0 with
# fbgemm-gpu-cpu 1.8.0 and torchrec 1.8.0 (installed without its fbgemm-gpu requirement;
# its other requirements by hand). psar is not installed there (bench/lib/torchrec_way.py).
#
#   bash bench/baselines/torchrec_venv.sh [DIR]     # default /work/venvs/torchrec
set -euo pipefail
dir="${1:-/work/venvs/torchrec}"
python3 -m venv "$dir"
pip=("$dir/bin/python" -m pip install -q)
# torch first, so nothing below pulls another release (a plain PyPI torch on x86_64 is a
# CUDA build of several GB: it runs on CPU too).
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "fbgemm-gpu-cpu==1.8.0"
"${pip[@]}" --no-deps "torchrec==1.8.0"
"${pip[@]}" "tensordict==0.15.3" "torchmetrics==1.0.3" tqdm pyre-extensions iopath
"$dir/bin/python" -c "import fbgemm_gpu, torchrec, torch; print('torchrec venv:', torch.__version__)"
