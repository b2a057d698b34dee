"""`python -m benchmarks.adaptive_finetune`: the benchmark's command line (`cli`)."""

from benchmarks.adaptive_finetune import cli
from odetransformer import errors

errors.run_cli(cli.main)
