"""`python -m odetransformer.memory`: the per-device memory a config needs, before renting devices.

The command's code lives in `odetransformer/tools/memory.py`; this module only keeps the
public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.memory", run_name="__main__", alter_sys=True)
