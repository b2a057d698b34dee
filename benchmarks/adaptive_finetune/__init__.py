"""Adaptive fine-tuning (paper Fig. 5) at CPU scale, run the way the authors' code runs it
(`python -m benchmarks.adaptive_finetune --help`; benchmarks/README.md, "Adaptive
fine-tuning").

`cli` holds the command line and the order of the runs; `runs` the runs' configs,
training and scores; `report` the table, PNG and ratio line. Nothing is imported here:
`python -m` imports this package before `__main__`, and `benchmarks/common.py` must first
be imported by the program itself (its huge-pages re-exec).
"""
