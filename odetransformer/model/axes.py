"""Logical axis names for parameters and activations, and sharding constraints by them.

Parameters carry `out_sharding` metadata made of these names; the training code maps
them to mesh axes with `nnx.logical_axis_rules(rules)` (MaxText's logical axis rules;
`odetransformer/train/sharding.py` holds the rules). Every rule set must name all of
`LOGICAL_AXES` (map an axis to None to replicate it).

`constrain` maps names by the rules in force, or by the rules it is given. Steps are
traced under activation rules, in which a weight axis such as 'embed' is not split (its
mesh axis already splits the batch); a weight computed inside a step — DiffEqFormer's
W(t) — must instead live where its parameters do, so the caller passes the parameters'
rules down to where it is made (the model's `param_rules` argument).
"""

import math

from flax.core import spmd as core_spmd
import jax

LOGICAL_AXES = (
  "batch",  # examples in a batch
  "length",  # sequence positions (activations, position table)
  "embed",  # model width d
  "heads",  # attention heads
  "kv",  # per-head width
  "mlp",  # feed-forward hidden width
  "vocab",  # vocabulary
  "time_embed",  # hypernetwork code width d_t (last axis of weight generators)
  "layers",  # stacked discrete layers
)


def constrain(x, names, rules=None):
  """Sharding constraint by logical `names`: mapped by `rules` ((name, mesh axes)
  pairs) when given, else by the rules in force (`nnx.logical_axis_rules`). A no-op
  outside a mesh context."""
  if jax.sharding.get_abstract_mesh().empty:
    return x
  spec = jax.sharding.PartitionSpec(*names)
  if rules is None:
    spec = core_spmd.apply_rules(spec, None)
  else:
    spec = jax.sharding.PartitionSpec(*core_spmd.from_sharding_rules(spec, rules))
  return jax.lax.with_sharding_constraint(x, spec)


def mesh_axis_size(mesh, target) -> int:
  """Number of devices a rule target (None, axis, tuple of axes) spans on `mesh` (a Mesh
  or an abstract one)."""
  if target is None:
    return 1
  targets = (target,) if isinstance(target, str) else target
  return math.prod(mesh.shape[t] for t in targets)


def shards(name: str) -> int:
  """How many ways the rules in force split logical axis `name` over the current mesh
  (1 outside a mesh context, or where the axis is not split)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return mesh_axis_size(mesh, core_spmd.apply_rules(jax.sharding.PartitionSpec(name), None)[0])
