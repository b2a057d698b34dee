"""Downstream commands on a trained run: evaluate, generate, export to Hugging Face,
lm-evaluation-harness and the memory estimate, each run as `python -m
odetransformer.tools.<name>`.

May import: `odetransformer.train`, `odetransformer.model`, `odetransformer.runtime`,
`odetransformer.errors`, `input_pipeline`. Only benchmarks and tests import the tools.
"""
