"""The console scripts pyproject.toml declares (`[project.scripts]`), one per command.

Each runs its command's module as `python -m MODULE` does (as `__main__`, with sys.argv
naming the module's file): absl prints the module's docstring and its own flags for
`--help`, and a module that must set the environment before jax is imported
(`odetransformer.memory`) still does so first. `odet-train` runs what `python main.py`
runs. `SCRIPTS` is the list pyproject.toml must agree with (tests/test_packaging.py).
"""

import runpy

# console script -> the module it runs (what `python -m` or `python main.py` runs).
SCRIPTS = {
  "odet-train": "odetransformer.tools.train",
  "odet-evaluate": "odetransformer.evaluate",
  "odet-generate": "odetransformer.generate",
  "odet-export": "odetransformer.export",
  "odet-import": "odetransformer.import_checkpoint",
  "odet-memory": "odetransformer.memory",
  "odet-lm-eval": "odetransformer.lm_eval",
  "odet-spectra": "odetransformer.analysis.spectra",
  "odet-lyapunov": "odetransformer.analysis.lyapunov",
  "odet-clustering": "odetransformer.analysis.clustering",
  "odet-prepare": "input_pipeline.prepare",
}


def _run(script: str) -> None:
  runpy.run_module(SCRIPTS[script], run_name="__main__", alter_sys=True)


def train() -> None:
  """`odet-train`: `python main.py`, the trainer."""
  _run("odet-train")


def evaluate() -> None:
  """`odet-evaluate`: `python -m odetransformer.evaluate`."""
  _run("odet-evaluate")


def generate() -> None:
  """`odet-generate`: `python -m odetransformer.generate`."""
  _run("odet-generate")


def export() -> None:
  """`odet-export`: `python -m odetransformer.export`."""
  _run("odet-export")


def import_checkpoint() -> None:
  """`odet-import`: `python -m odetransformer.import_checkpoint`."""
  _run("odet-import")


def memory() -> None:
  """`odet-memory`: `python -m odetransformer.memory`."""
  _run("odet-memory")


def lm_eval() -> None:
  """`odet-lm-eval`: `python -m odetransformer.lm_eval`."""
  _run("odet-lm-eval")


def spectra() -> None:
  """`odet-spectra`: `python -m odetransformer.analysis.spectra`."""
  _run("odet-spectra")


def lyapunov() -> None:
  """`odet-lyapunov`: `python -m odetransformer.analysis.lyapunov`."""
  _run("odet-lyapunov")


def clustering() -> None:
  """`odet-clustering`: `python -m odetransformer.analysis.clustering`."""
  _run("odet-clustering")


def prepare() -> None:
  """`odet-prepare`: `python -m input_pipeline.prepare`."""
  _run("odet-prepare")
