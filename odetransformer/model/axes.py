"""Logical axis names for parameters and activations, and activation constraints.

Parameters carry `out_sharding` metadata made of these names; the training code maps
them to mesh axes with `nnx.logical_axis_rules(rules)` (MaxText's logical axis rules).
Every rule set must name all of `LOGICAL_AXES` (map an axis to None to replicate it).

Steps are traced under activation rules (`sharding.activation_rules`), in which a
weight axis such as 'embed' is not split (its mesh axis already splits the batch).
Weights that are computed inside a step — DiffEqFormer's W(t) — must instead live where
their parameters do; `weight_rules` says which rules those are and `constrain_weight`
applies them.
"""
import contextlib
import contextvars

import jax
from flax.core import spmd as core_spmd

LOGICAL_AXES = (
    "batch",       # examples in a batch
    "length",      # sequence positions (activations, position table)
    "embed",       # model width d
    "heads",       # attention heads
    "kv",          # per-head width
    "mlp",         # feed-forward hidden width
    "vocab",       # vocabulary
    "time_embed",  # hypernetwork code width d_t (last axis of weight generators)
    "layers",      # stacked discrete layers
)

# Parameters whose paths contain one of these are excluded from weight decay:
# norms and biases (time-dependent or not), and LoRA adapters.
NO_DECAY_NAMES = ("norm", "bias", "bq", "bk", "bv", "bo", "b1", "b2", "lora")


def is_decayed(path) -> bool:
  """Whether the parameter at `path` (tuple of keys) gets weight decay."""
  parts = [str(getattr(p, "key", p)) for p in path]
  for part in parts:
    if any(part == n or part.startswith(n + "_") or (n == "norm" and "norm" in part)
           for n in NO_DECAY_NAMES):
      return False
  return True


def constrain(x, names):
  """Sharding constraint by logical names; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = core_spmd.apply_rules(jax.sharding.PartitionSpec(*names), None)
  return jax.lax.with_sharding_constraint(x, spec)


_WEIGHT_RULES = contextvars.ContextVar("odetransformer_weight_rules", default=None)


@contextlib.contextmanager
def weight_rules(rules):
  """Within the block, `constrain_weight` maps names by `rules` (the parameter rules)."""
  token = _WEIGHT_RULES.set(tuple(rules))
  try:
    yield
  finally:
    _WEIGHT_RULES.reset(token)


def constrain_weight(x, names):
  """Sharding constraint for a weight computed in a step (a generated W(t)): by the
  `weight_rules` in force, so it is sharded as a parameter with those logical axes is;
  outside them, as `constrain` (the current rules). A no-op outside a mesh context."""
  rules = _WEIGHT_RULES.get()
  if rules is None:
    return constrain(x, names)
  if jax.sharding.get_abstract_mesh().empty:
    return x
  table = dict(rules)
  spec = jax.sharding.PartitionSpec(*(None if n is None else table[n] for n in names))
  return jax.lax.with_sharding_constraint(x, spec)
