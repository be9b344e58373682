"""The plain programs psar is measured against, with no psar code in them: a plain DDP
script (`plain_ddp.py`), parameter servers on torch.distributed.rpc (`rpc_ps.py`) and raw
loopback TCP (`tcp.py`). torchrun runs the first two as files; each writes per-step logs
in the format of `psar train --run-dir`, so the benchmarks read every run alike."""
