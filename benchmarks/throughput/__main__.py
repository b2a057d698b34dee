"""`python -m benchmarks.throughput`: the benchmark's command line (`cli`)."""

from benchmarks.throughput import cli
from odetransformer import errors

errors.run_cli(cli.main)
