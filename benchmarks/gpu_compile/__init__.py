"""The real train step compiled for an H100 on a CPU machine: where every byte of a step
goes (`python -m benchmarks.gpu_compile --help`; benchmarks/README.md, "The train step
compiled for an H100 (no GPU needed)").

`cli` holds the command line and the compiles; `hlo_bytes` reads the optimized HLO and
the thunk sequence into kernels, copies and bytes by category. Nothing is imported here:
`python -m` imports this package before `__main__`, which sets up the compile-only
platform before jax is imported.
"""
