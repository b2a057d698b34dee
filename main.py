"""Trains (or resumes) a model from a config file: `python main.py --config=... --workdir=...`.

The trainer's code, its flags and what it does are in `odetransformer/tools/train.py`
(`--help` prints them); installed, the same command is `odet-train`. This file keeps the
README's command working from the repository root.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.train", run_name="__main__", alter_sys=True)
