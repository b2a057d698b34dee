"""Train-step throughput, DiffEqFormer vs GPT on the same shape (and against nanoGPT's
step with `--nanogpt`) (`python -m benchmarks.throughput --help`; benchmarks/README.md,
"Throughput (CPU health check)" and "Speed against nanoGPT on one GPU").

`cli` holds the command line and the timed runs; `profile_split` sums a jax.profiler
trace's device ops by kind (`--profile`); `nanogpt_step` times nanoGPT's own train step
in a child process of its own (`python -m benchmarks.throughput.nanogpt_step`: torch,
no jax). Nothing is imported here: `python -m` imports this package before `__main__`
(or before nanogpt_step), and `benchmarks/common.py` must first be imported by the program
itself (its huge-pages re-exec).
"""
