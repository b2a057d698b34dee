"""Fine-tune, or train on, a checkpoint imported with `odetransformer.import_checkpoint`.

The workdir to start from is the config's argument (after a colon); the model's shape and
context are read from its config.json, so nothing needs repeating on the command line:

  python -m odetransformer.import_checkpoint --from=PATH --workdir=/tmp/odet_imported
  python main.py --config=configs/finetune_imported.py:/tmp/odet_imported \
      --workdir=/tmp/odet_imported_ft --config.finetune.method=full \
      --config.data.train_files=GLOB --config.data.eval_files=GLOB

`finetune.method` is 'full' (every weight) or 'lora' (rank-r adapters); for a DiffEqFormer
fitted to the checkpoint (`--fit=diffeqformer`) also 'continuous', at any
`finetune.solver_steps`. Without data flags it trains on the Python standard library's
sub-packages, as configs/finetune_default.py does (offline, and new text to any model).
The tokenizer is always the imported one.
"""

import json
import os

from configs import finetune_default

DEFAULT_WORKDIR = "/tmp/odet_imported"


def get_config(init_from: str = DEFAULT_WORKDIR):
  config = finetune_default.get_config()
  config.init_from = init_from or DEFAULT_WORKDIR
  config.finetune.method = "full"
  config.optim.learning_rate = 1e-4  # a pretrained model: a gentle step
  recorded = os.path.join(config.init_from, "config.json")
  if os.path.isfile(recorded):  # else main.py names the missing workdir in one line
    with open(recorded, encoding="utf-8") as f:
      saved = json.load(f)
    for key, value in saved["model"].items():
      if key in config.model:
        config.model[key] = value
    config.seq_len = int(saved.get("seq_len", config.seq_len))
    config.data.vocab_size = int(saved["data"]["vocab_size"])
  return config
