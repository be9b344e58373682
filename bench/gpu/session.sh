#!/usr/bin/env bash
# The GPU benchmark: everything a session lent a GPU machine runs there, in one go (about
# 7 minutes; each step has its own timeout): the CUDA side of trainkit/device_io.py,
# bench/gpu/check.py, bench/gpu/scale.py and the shard update benchmark on the machine's
# cores. The processes they start run under worker/supervisor.py. Results go
# to $OUT (the device tool's folder) or runs/gpu; put a row (and the table) under the
# day's date in docs/results.md with the device and torch, and the headline into
# bench/README.md ("GPU").
#
#   bash bench/gpu/session.sh            # from the repository root
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  $py -c "import torch, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpc', grpc.__version__)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$out/$name.out" 2> "$out/$name.err"
  echo "rc=$? in $((SECONDS - t0)) s"
  tail -c 1500 "$out/$name.out"; tail -n 5 "$out/$name.err"
}
step device_io 60 $py -m pytest -q -p no:cacheprovider tests/test_device_io_cuda.py
step shard_update 60 $py bench/shard_update.py --json --threads auto --reps 3
step gpu_check 120 $py -m bench.gpu.check --steps 60 --timeout-s 60 --json --out "$out/check"
step gpu_scale 300 $py -m bench.gpu.scale --json --timeout-s 60 --out "$out/scale" \
  --server-args "${SERVER_ARGS:---torch-threads auto}"
# Everything in one file (the device tool brings back a few files only).
tar czf "$out/runs.tgz" -C "$out" --exclude runs.tgz . && ls -la "$out/runs.tgz"
