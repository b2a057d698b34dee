"""Adaptive fine-tuning: start from a pre-trained run at any number of steps N.

A fine-tuning config names the pre-training workdir (`init_from`) and `finetune.*`:

- `continuous`: keep the hypernetworks and train them, run at N steps;
- `full`: materialise N discrete layers (ODE) — or keep a discrete model — and train
  all weights;
- `lora`: as `full`, then freeze the layers and train low-rank adapters (rank, alpha,
  targets; B = 0 so step 0 is the base model), optionally the embeddings too.

The fine-tuning run is an ordinary run: its model config (derived here) is saved with
its checkpoints, so it resumes, evaluates and generates like any other. Only its first
start reads `init_from`. The tokenizer is the pre-training run's.
"""
import dataclasses
import os

from flax import nnx

from odetransformer import checkpointing, loading, train
from odetransformer.config import ModelConfig
from odetransformer.errors import UserError
from odetransformer.materialize import materialize

METHODS = ("continuous", "full", "lora")
# Fields that must agree with the pre-trained model (the weights are reused).
_SHAPE_FIELDS = ("flavour", "d_model", "num_heads", "mlp_dim", "time_embed_dim",
                 "time_sinusoids", "time_hidden", "shared_time_mlp", "tie_embeddings",
                 "max_len")


class FinetuneError(UserError, ValueError):
  """A fine-tuning config that cannot start from its `init_from` run."""


def pretrained_config(config):
  """(pre-training run ConfigDict, its ModelConfig)."""
  src = config.init_from
  if not src or not os.path.exists(os.path.join(src, checkpointing.CONFIG_FILE)):
    raise FinetuneError(f"init_from={src!r} is not a training workdir "
                        f"({checkpointing.CONFIG_FILE} missing); point it at a main.py run")
  pre = checkpointing.load_config(src)
  return pre, train.model_config(pre, vocab_size=pre.data.vocab_size)


def finetune_model_config(config) -> ModelConfig:
  """The model the fine-tuning run trains (depends on method and N)."""
  _, pre = pretrained_config(config)
  ft = config.finetune
  method = ft.method
  if method not in METHODS:
    raise FinetuneError(f"finetune.method={method!r} is unknown; choose one of {list(METHODS)}")
  for field in _SHAPE_FIELDS:
    if field in config.model and config.model[field] != getattr(pre, field):
      raise FinetuneError(
          f"model.{field}={config.model[field]!r} differs from the pre-trained model's "
          f"{getattr(pre, field)!r} (init_from={config.init_from}); remove the override")
  n = int(ft.num_steps) or pre.num_steps
  if n <= 0:
    raise FinetuneError(f"finetune.num_steps={n} must be positive")
  keep = dict(dropout_rate=float(config.model.get("dropout_rate", pre.dropout_rate)),
              remat_policy=config.model.get("remat_policy", pre.remat_policy),
              dtype=config.model.get("dtype", pre.dtype))
  if method == "continuous":
    if not pre.is_ode:
      raise FinetuneError(f"finetune.method='continuous' needs an ODE model; the "
                          f"pre-trained model is kind={pre.kind!r} (use 'full' or 'lora')")
    return dataclasses.replace(pre, num_steps=n, **keep)
  if pre.is_ode:
    disc = dataclasses.replace(pre, kind="parallel", num_steps=n, **keep)
  else:
    if n != pre.num_steps:
      raise FinetuneError(f"a discrete {pre.kind!r} model has {pre.num_steps} layers; "
                          f"finetune.num_steps={n} needs an ODE model")
    disc = dataclasses.replace(pre, **keep)
  if method == "full":
    return disc
  return dataclasses.replace(
      disc, lora_rank=int(ft.lora_rank), lora_alpha=float(ft.lora_alpha),
      lora_targets=tuple(t.strip() for t in str(ft.targets).split(",") if t.strip()),
      lora_train_embeddings=bool(ft.get("train_embeddings", False)))


def prepare_config(config):
  """Fills what a fine-tuning run inherits: model fields (for the record) and tokenizer."""
  pre, _ = pretrained_config(config)
  cfg = finetune_model_config(config)
  with config.unlocked():
    for field in dataclasses.fields(cfg):
      value = getattr(cfg, field.name)
      config.model[field.name] = ",".join(value) if isinstance(value, tuple) else value
    tokenizer = os.path.join(config.init_from, loading.TOKENIZER_FILE)
    if not config.data.get("tokenizer_path"):
      config.data.tokenizer_path = (tokenizer if os.path.exists(tokenizer)
                                    else pre.data.get("tokenizer_path", ""))
    if int(config.data.vocab_size) != int(pre.data.vocab_size):
      raise FinetuneError(f"data.vocab_size={config.data.vocab_size} differs from the "
                          f"pre-trained run's {pre.data.vocab_size}; the tokenizer is shared")
  return config


def initial_model_state(config, cfg: ModelConfig) -> nnx.State:
  """The pre-trained weights transformed for this method (values for `nnx.update`)."""
  loaded = loading.load_model(config.init_from)
  model = loaded.model
  if config.finetune.method != "continuous" and model.config.is_ode:
    model = materialize(model, cfg.num_steps)
  return nnx.state(model)
