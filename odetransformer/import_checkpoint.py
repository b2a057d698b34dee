"""`python -m odetransformer.import_checkpoint`: a pretrained GPT-2 or Llama checkpoint (a
Hugging Face model directory or a GGUF file) as a run's workdir.

The command's code lives in `odetransformer/tools/import_checkpoint.py`; this module only
keeps the public command name short and stable.
"""

import runpy

if __name__ == "__main__":
  runpy.run_module("odetransformer.tools.import_checkpoint", run_name="__main__", alter_sys=True)
