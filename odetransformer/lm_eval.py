"""`python -m odetransformer.lm_eval`: lm-evaluation-harness on a trained run.

The command's code lives in `odetransformer/tools/lm_eval.py`; this module only keeps the
public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.lm_eval", run_name="__main__", alter_sys=True)
