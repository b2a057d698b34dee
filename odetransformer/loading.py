"""Load a trained model (and its tokenizer) from a training workdir.

For tools that need only the model — evaluation, generation, materialisation,
analysis, fine-tuning's `init_from` — this restores just the checkpoint's `model`
item, onto one device by default or sharded on a given mesh.
"""
import dataclasses
import os
from typing import Optional

import jax
from absl import logging
from flax import nnx

from odetransformer import checkpointing, sharding
from odetransformer.checkpointing import TOKENIZER_FILE
from odetransformer.config import ModelConfig, model_config
from odetransformer.errors import UserError
from odetransformer.model import LanguageModel, create_model


@dataclasses.dataclass
class Loaded:
  model: LanguageModel
  model_config: ModelConfig
  config: object          # the run's ml_collections.ConfigDict
  step: int


def load_model(workdir: str, step: Optional[int] = None, mesh=None,
               allow_unverified: bool = False) -> Loaded:
  """The model of the latest (or given) checkpoint in `workdir` that restores.

  Raises a one-line UserError when there is no run, no checkpoint or none restores
  (one without its integrity record only with `allow_unverified`).
  """
  try:
    config = checkpointing.load_config(workdir)
  except (FileNotFoundError, NotADirectoryError) as e:
    raise UserError(f"{workdir} holds no training run ({checkpointing.CONFIG_FILE} "
                    "missing, no checkpoint); pass the --workdir of a main.py run") from e
  except (OSError, ValueError) as e:
    raise UserError(f"{os.path.join(workdir, checkpointing.CONFIG_FILE)} is unreadable "
                    f"({type(e).__name__}: {e}); it describes the run's checkpoints: "
                    "restore it, or resume the run with main.py to rewrite it") from e
  cfg = model_config(config, vocab_size=config.data.get("vocab_size"))
  if mesh is None:
    mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rules = sharding.logical_axis_rules(config.get("mesh"))
  with nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.get_abstract_model(lambda: create_model(cfg), mesh)
  state, restored_step = checkpointing.restore_model_state(workdir, abstract, step,
                                                           allow_unverified)
  return Loaded(model=nnx.merge(graphdef, state), model_config=cfg, config=config,
                step=int(restored_step))


def tokenizer_path(workdir: str, config=None) -> str:
  """The .model file of a run's tokenizer.

  `<workdir>/tokenizer.model` (written by main.py at start) if present, else
  `data.tokenizer_path`, else the tokenizer the run's data config trained and cached
  (found, or re-created deterministically, by `input_pipeline.create_datasets`).
  """
  path = os.path.join(workdir, TOKENIZER_FILE)
  if os.path.exists(path):
    return path
  config = checkpointing.load_config(workdir) if config is None else config
  if config.data.get("tokenizer_path") and os.path.exists(config.data.tokenizer_path):
    return config.data.tokenizer_path
  import input_pipeline  # pylint: disable=g-import-not-at-top
  ds = input_pipeline.create_datasets(
      config.data, seq_len=int(config.seq_len), global_batch_size=1, eval_batch_size=1,
      seed=int(config.seed), workdir=workdir, process_index=0, process_count=1)
  logging.warning("%s has no %s: using the tokenizer its data config caches (%s)",
                  workdir, TOKENIZER_FILE, ds.tokenizer_path)
  return ds.tokenizer_path


def load_tokenizer(workdir: str, config=None):
  """The run's SentencePiece processor (pad=0, unk=1, bos=2, eos=3)."""
  from input_pipeline import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  config = checkpointing.load_config(workdir) if config is None else config
  return tokenizer_lib.load(tokenizer_path(workdir, config), int(config.data.vocab_size))
