"""Downstream commands on a trained run: evaluate, generate, export to Hugging Face,
lm-evaluation-harness and the memory estimate. Users run them as `python -m
odetransformer.<name>`: a launcher at the package root keeps the public name.

May import: `odetransformer.train`, `odetransformer.model`, `odetransformer.runtime`,
`odetransformer.errors`, `input_pipeline`. Only benchmarks and tests import the tools.
"""
