"""`python -m benchmarks.gpu_compile`: the benchmark's command line (`cli`)."""

import os

# Before jax: compile-only CUDA devices need the CPU platform (no driver probe).
os.environ["JAX_PLATFORMS"] = "cpu"

from benchmarks.gpu_compile import cli  # noqa: E402
from odetransformer import errors  # noqa: E402

errors.run_cli(cli.main)
