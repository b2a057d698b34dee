"""Single epoch: DiffEqFormer vs GPT pre-trained on one pass of real text, no token twice
(`python -m benchmarks.single_epoch --help`; benchmarks/README.md, "Single epoch").

`cli` holds the command line and the order of the runs of the preset mode; `config_mode`
the --config mode's (GPT-2 small on one GPU); `runs` one run's config, training and
scores; `corpus` the epoch's count and the check that no document was served twice;
`report` the tables, PNG and ratio lines; `analysis` the spectra, Lyapunov and clustering
stage. Nothing is imported here: `python -m` imports this package before `__main__`, and
`benchmarks/common.py` must first be imported by the program itself (its huge-pages
re-exec).
"""
