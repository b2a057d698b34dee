"""`python -m odetransformer.export`: a trained run as a Hugging Face model directory.

The command's code lives in `odetransformer/tools/export.py`; this module only keeps the
public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.export", run_name="__main__", alter_sys=True)
