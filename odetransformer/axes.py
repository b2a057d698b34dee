"""Logical axis names for parameters and activations, and activation constraints.

Parameters carry `out_sharding` metadata made of these names; the training code maps
them to mesh axes with `nnx.logical_axis_rules(rules)` (MaxText's logical axis rules).
Every rule set must name all of `LOGICAL_AXES` (map an axis to None to replicate it).
"""
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
