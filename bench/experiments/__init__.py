"""One-off experiments: each answered one question of an issue, and its results are in
docs/results.md with the command that produced them. Kept runnable (`python -m
bench.experiments.NAME`), not part of the suite (`python -m bench`)."""
