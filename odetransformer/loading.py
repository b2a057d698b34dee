"""Load a trained model (and its tokenizer) from a training workdir.

For tools that need only the model — evaluation, generation, materialisation,
analysis, fine-tuning's `init_from` — this restores just the checkpoint's `model`
item, onto one device by default or sharded on a given mesh.
"""
import dataclasses
import os
from typing import Optional

import jax
from flax import nnx

from odetransformer import checkpointing, sharding, train
from odetransformer.config import ModelConfig
from odetransformer.model import LanguageModel, create_model

TOKENIZER_FILE = "tokenizer.model"


@dataclasses.dataclass
class Loaded:
  model: LanguageModel
  model_config: ModelConfig
  config: object          # the run's ml_collections.ConfigDict
  step: int


def load_model(workdir: str, step: Optional[int] = None, mesh=None) -> Loaded:
  """The model of the latest (or given) checkpoint in `workdir`.

  Raises FileNotFoundError with a one-line message when there is no run or checkpoint.
  """
  if not os.path.exists(os.path.join(workdir, checkpointing.CONFIG_FILE)):
    raise FileNotFoundError(f"{workdir} holds no training run ({checkpointing.CONFIG_FILE} "
                            "missing); pass the --workdir of a main.py run")
  config = checkpointing.load_config(workdir)
  cfg = train.model_config(config, vocab_size=config.data.get("vocab_size"))
  if mesh is None:
    mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rules = sharding.logical_axis_rules(config.get("mesh"))
  with nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.get_abstract_model(lambda: create_model(cfg), mesh)
  state, restored_step = checkpointing.restore_model_state(workdir, abstract, step)
  return Loaded(model=nnx.merge(graphdef, state), model_config=cfg, config=config,
                step=int(restored_step))


def load_tokenizer(workdir: str):
  """The run's SentencePiece tokenizer: `<workdir>/tokenizer.model`, else the data cache."""
  from input_pipeline import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  config = checkpointing.load_config(workdir)
  path = os.path.join(workdir, TOKENIZER_FILE)
  if not os.path.exists(path):
    path = config.data.get("tokenizer_path") or ""
  if not path or not os.path.exists(path):
    raise FileNotFoundError(f"no tokenizer found for {workdir}: expected {TOKENIZER_FILE} "
                            "there (written by main.py at start) or data.tokenizer_path")
  return tokenizer_lib.load(path, int(config.data.vocab_size))
