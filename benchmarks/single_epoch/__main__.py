"""`python -m benchmarks.single_epoch`: the benchmark's command line (`cli`)."""

from benchmarks.single_epoch import cli
from odetransformer import errors

errors.run_cli(cli.main)
