"""Analysis tools of the paper's Section 5 (DESIGN.md §7).

Each tool is a library of pure functions that return numbers, plus a thin absl
`main` run as a module:

    python -m odetransformer.analysis.spectra --workdir=W --out=DIR [--grid=64]
    python -m odetransformer.analysis.lyapunov --workdir=W --text="..." --out=DIR
    python -m odetransformer.analysis.clustering --out=DIR

`fields` holds what the first two share: a model's layer weights along t (or per
layer) and its vector field for one sequence. `lyapunov` is the command line; its
computation is `lyapunov_exponents` and its files and summary `lyapunov_report`.
"""
