"""LoRA (Hu et al.): low-rank adapters on a discrete model's stacked layer weights.

A target weight W [L, *shape] (its ParamSpec's first `n_in` axes are its inputs, the
rest its outputs) gets factors A [L, n_in, r] and B [L, r, n_out], and the layer runs
W0 + (alpha/r)·A·B with W0 held fixed (`Frozen`). `DiscreteStack` holds the factors
(`init_adapters`) and applies them (`apply`); fine-tuning starts them (`factor_shapes`);
export merges them (`merge_lora`).
"""

import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp


class Frozen(nnx.Variable):
  """A weight held fixed in training: not an `nnx.Param`, so it gets no gradient and no
  optimizer state (LoRA's base weights), yet it is checkpointed and sharded as usual."""


class LoraParam(nnx.Param):
  """A LoRA factor (A or B)."""


def factor_shapes(spec, rank: int, num_layers: int) -> tuple:
  """(A's shape [L, n_in, r], B's shape [L, r, n_out]) for a target of ParamSpec `spec`."""
  n_in = math.prod(spec.shape[: spec.n_in])
  n_out = math.prod(spec.shape[spec.n_in :])
  return (num_layers, n_in, rank), (num_layers, rank, n_out)


def init_adapters(cfg, specs: dict, rngs: nnx.Rngs) -> nnx.Dict:
  """{target: {'a', 'b'}} for `cfg.lora_targets`: A ~ N(0, 1/n_in), B = 0, so
  W0 + s·A·B is W0 at initialisation."""
  dtype = jnp.dtype(cfg.param_dtype)
  adapters = {}
  for name in cfg.lora_targets:
    a_shape, b_shape = factor_shapes(specs[name], cfg.lora_rank, cfg.depth)
    a = jax.random.normal(rngs.params(), a_shape, dtype) / math.sqrt(a_shape[1])
    adapters[name] = nnx.Dict(
      a=LoraParam(a, out_sharding=("layers", None, None)),
      b=LoraParam(jnp.zeros(b_shape, dtype), out_sharding=("layers", None, None)),
    )
  return nnx.Dict(adapters)


def scale(cfg) -> float:
  """s = alpha/r (0 without adapters)."""
  return cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0


def apply(layers: dict, adapters, s: float) -> dict:
  """`layers` (name -> [L, *shape]) with W0 + s·A·B on every adapted target."""
  out = dict(layers)
  for name, ab in adapters.items():
    w = out[name]
    delta = jnp.einsum("lir,lro->lio", ab["a"][...], ab["b"][...])
    out[name] = w + (s * delta).reshape(w.shape).astype(w.dtype)
  return out


def merge_lora(model):
  """A plain discrete model (no adapters, all weights trainable) with W = W0 + s·A·B.

  A materialised ODE's step size (`out_proj_scale`, over W_O, W_2 and their updates) is
  folded into the merged weights, so the result computes the same function with scale 1.
  """
  cfg = model.config
  if not cfg.lora_rank:
    raise ValueError("this model has no LoRA adapters to merge")
  plain = dataclasses.replace(cfg, lora_rank=0, lora_train_embeddings=False, out_proj_scale=1.0)
  return model.with_layers(plain, model.layer_weights(jnp.dtype(cfg.param_dtype)))
