"""What the benchmarks share (bench/README.md): jobs, step logs and rates, output
(`common`), emulated hosts (`netem`), the data-path client (`datapath`), CPU accounting
(`cpuwindow`, `cpucost`), the crossover and loopback grids (`grid`, `scaling`) and the
suite runner (`suite`, `python -m bench`). Top-level scripts import from here, never the
other way round."""
