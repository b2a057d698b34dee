"""Fine-tune a configs/default.py run at any step count, on text it has not seen.

Pre-train first (the README's default run), then fine-tune; `finetune.method` is
'continuous' (keep the hypernetworks, run them at N steps), 'full' (materialise N
layers, train them all) or 'lora' (materialise N layers, train rank-r adapters):

  python main.py --config=configs/default.py --workdir=/tmp/odet_default
  python main.py --config=configs/finetune_default.py --workdir=/tmp/odet_ft \
      --config.init_from=/tmp/odet_default --config.finetune.method=lora \
      --config.finetune.solver_steps=6

The new text is the Python standard library's sub-packages (asyncio, email, json, …),
which the embedded pre-training corpus (top-level modules only) never contains;
offline on every machine. Any text works: --config.data.train_files=GLOB
--config.data.eval_files=GLOB. The tokenizer is always the pre-training run's.

Expect: the first evaluation (step 0 of LoRA) equals the pre-trained model's loss on
this text, and the loss falls from there; the time it takes is in benchmarks/README.md
(Quality).
"""

import ml_collections

from configs import default
from input_pipeline.embedded import stdlib_dir

# Sub-packages of the standard library: new text for a model pre-trained on top-level modules.
_TRAIN_PACKAGES = ("asyncio", "email", "concurrent", "importlib", "xml", "http", "logging")
_EVAL_PACKAGES = ("json", "urllib")


def _globs(packages):
  return ",".join(str(stdlib_dir() / p / "*.py") for p in packages)


def get_config():
  config = default.get_config()
  config.init_from = "/tmp/odet_default"  # a pre-training workdir (config.json + checkpoints)
  config.finetune = ml_collections.ConfigDict()
  config.finetune.method = "lora"  # 'continuous' | 'full' | 'lora'
  # N solver steps (ODE) / layers; None = the pre-trained model's K (or its L)
  config.finetune.solver_steps = ml_collections.config_dict.placeholder(int)
  # Deprecated name of solver_steps (0 = the pre-trained K), kept so old flags parse:
  config.finetune.num_steps = ml_collections.config_dict.placeholder(int)
  config.finetune.lora_rank = 8  # adapter rank r
  config.finetune.lora_alpha = 16.0  # adapter scale alpha / r
  config.finetune.targets = "wq,wk,wv,wo"  # adapted layer weights (wq wk wv wo w1 w2 [w3])
  config.finetune.train_embeddings = False  # LoRA: also train embeddings and final norm

  config.num_train_steps = 200
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 100
  config.optim.learning_rate = 1e-3
  config.data.source = "local"
  config.data.train_files = _globs(_TRAIN_PACKAGES)
  config.data.eval_files = _globs(_EVAL_PACKAGES)
  return config
