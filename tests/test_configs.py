"""Every experiment config loads, validates, and matches the paper's settings."""
import importlib
import pathlib
import re

import pytest

from odetransformer import train

CONFIG_DIR = pathlib.Path(__file__).parents[1] / "configs"
TOP_LEVEL = ("num_train_steps", "eval_every_steps", "checkpoint_every_steps", "log_every_steps",
             "global_batch_size", "eval_batch_size", "seed", "seq_len", "model", "data",
             "optim", "mesh")
# Table 3: (layers/steps, d_model, heads, mlp, flavour), and (lr, b2, batch)
PAPER = {
    "owt_small": ((12, 768, 12, 3072, "gpt"), (3e-4, 0.999, 512)),
    "owt_medium": ((24, 1024, 16, 4096, "gpt"), (3e-4, 0.999, 256)),
    "owt_large": ((36, 1280, 20, 5120, "gpt"), (3e-4, 0.95, 256)),
    "owt_llama_1b": ((16, 2048, 16, 8192, "llama"), (3e-4, 0.95, 256)),
    "wikitext103_small": ((12, 768, 12, 3072, "gpt"), (6e-4, 0.999, 512)),
    "wikitext103_medium": ((24, 1024, 16, 4096, "gpt"), (6e-4, 0.999, 512)),
}


CONFIGS = ["default"] + sorted(PAPER)   # pre-training configs (fine-tuning ones: elsewhere)


def load(name):
  return importlib.import_module(f"configs.{name}").get_config()


def test_pretraining_configs_exist():
  assert all((CONFIG_DIR / f"{name}.py").exists() for name in CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kind", ["diffeqformer", "gpt"])
def test_config_loads_and_model_validates(name, kind):
  c = load(name)
  for key in TOP_LEVEL:
    assert key in c, key
  c.model.kind = kind                                # the one baseline switch
  cfg = train.model_config(c, c.data.vocab_size)
  assert cfg.kind == kind
  assert c.seq_len <= cfg.max_len
  doc = importlib.import_module(f"configs.{name}").__doc__
  assert f"python main.py --config=configs/{name}.py" in doc
  assert re.search(r"[Ee]xpect", doc)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_settings(name):
  c = load(name)
  (layers, d, heads, mlp, flavour), (lr, b2, batch) = PAPER[name]
  m = c.model
  assert (m.num_steps, m.d_model, m.num_heads, m.mlp_dim, m.flavour) == (layers, d, heads, mlp,
                                                                       flavour)
  assert (m.time_embed_dim, m.time_sinusoids, m.dropout_rate) == (96, 128, 0.1)
  assert (c.optim.learning_rate, c.optim.b2, c.global_batch_size) == (lr, b2, batch)
  assert (c.optim.weight_decay, c.optim.warmup_frac, c.optim.min_lr_ratio) == (0.1, 0.01, 0.1)
  assert c.optim.schedule == "cosine" and c.seq_len == 1024
  assert c.data.source == ("wikitext103" if name.startswith("wikitext") else "openwebtext")
