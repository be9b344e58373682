"""The GPU benchmark's parts, run by bench/gpu/session.sh on a CUDA machine: `check` (NCCL
DDP and fp16 CUDA PS workers behave, and their throughput) and `scale` (what the parameter
server adds to a 57M-parameter LM's step on one GPU). Both run a scaled-down CPU variant
or skip where there is no CUDA."""
