"""`python -m odetransformer.evaluate`: a run's perplexity at one or more solver step counts.

The command's code lives in `odetransformer/tools/evaluate.py`; this module only keeps the
public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.evaluate", run_name="__main__", alter_sys=True)
