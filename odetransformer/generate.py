"""`python -m odetransformer.generate`: text from a trained run (KV-cache decoding).

The command's code lives in `odetransformer/tools/generate.py`; this module only keeps the
public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.generate", run_name="__main__", alter_sys=True)
