"""The device mesh and the logical-axis rules that map model axes onto it.

Parameters and activations carry logical axis names (`odetransformer.model.axes`); only
the rules here (overridable from `config.mesh.rules`) say which mesh axis each one
is split over (MaxText's `logical_axis_rules`). The mesh has three axes:

  data    pure data parallelism (params replicated)
  fsdp    data parallelism with params, gradients and optimizer state split (ZeRO-3)
  tensor  tensor (model) parallelism over heads, MLP width and vocabulary

Axes are `AxisType.Auto` (GSPMD style): jax 0.10 defaults to Explicit, which breaks the
embedding gather in a pjit-style step.
"""

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.axes import LOGICAL_AXES, mesh_axis_size

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (a name, a tuple of names, or None = replicated).
DEFAULT_RULES = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv", None),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("time_embed", None),
  ("layers", None),
)


class MeshError(UserError, ValueError):
  """A mesh or rule setting that cannot work on the devices at hand."""


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple:
  """Replaces at most one -1 in `shape` by what is left of `num_devices`."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise MeshError(f"mesh.shape={shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
  if sum(s == -1 for s in shape) > 1:
    raise MeshError(f"mesh.shape={shape}: at most one entry may be -1")
  if any(s == 0 or s < -1 for s in shape):
    raise MeshError(f"mesh.shape={shape}: entries must be positive or -1")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if num_devices % known:
      raise MeshError(f"mesh.shape={shape} does not divide the {num_devices} devices")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) != num_devices:
    raise MeshError(
      f"mesh.shape={shape} needs {int(np.prod(shape))} devices, "
      f"but there are {num_devices}; use -1 for 'the rest'"
    )
  return shape


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The ('data', 'fsdp', 'tensor') mesh from `config.mesh.shape`, with Auto axes."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config.shape, len(devices))
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
  )


def _as_mesh_axes(value):
  """Config value -> rule target: None, 'axis' or a tuple of axes.

  Accepts None, '' (replicated), 'fsdp', 'data,fsdp' (command-line friendly) or a
  list/tuple of axis names.
  """
  if isinstance(value, str):
    value = tuple(v.strip() for v in value.split(",") if v.strip())
  if value is None:
    return None
  value = tuple(value)
  if not value:
    return None
  return value[0] if len(value) == 1 else value


def rules_to_config(rules=DEFAULT_RULES) -> dict:
  """Rules as the `mesh.rules` config dict: name -> 'axis' / 'a,b' / '' (replicated)."""

  def fmt(target):
    if target is None:
      return ""
    return target if isinstance(target, str) else ",".join(target)

  return {name: fmt(target) for name, target in rules}


def logical_axis_rules(overrides: Mapping | None = None) -> tuple:
  """Rules for `nnx.logical_axis_rules`: DEFAULT_RULES with `overrides` (`mesh.rules`).

  `mesh.rules` maps a logical name to a mesh axis ('fsdp'), several ('data,fsdp'),
  or none ('' or None: replicated). Every logical name must end up with a rule: flax
  passes an unknown name through unchanged, which would then fail deep inside sharding
  with a cryptic error.
  """
  rules = dict(DEFAULT_RULES)
  for name, value in dict(overrides or {}).items():
    rules[name] = _as_mesh_axes(value)
  missing = [n for n in LOGICAL_AXES if n not in rules]
  if missing:
    raise MeshError(f"no logical-axis rule for {missing}; add them to mesh.rules")
  for name, target in rules.items():
    targets = (target,) if isinstance(target, str) else (target or ())
    bad = [t for t in targets if t not in MESH_AXES]
    if bad:
      raise MeshError(
        f"mesh.rules[{name!r}]={target!r} names unknown mesh axes {bad}; valid: {list(MESH_AXES)}"
      )
  return tuple(rules.items())


def activation_rules(rules) -> tuple:
  """The rules used while tracing the train/eval steps (activation constraints).

  Activations and parameters share logical names ('embed' is both a weight axis and
  the residual stream's width). A weight's 'embed' may live on 'fsdp', but an
  activation is already split over 'fsdp' through its 'batch' axis, and one mesh axis
  cannot shard two dimensions. So activations use the same rules minus the mesh axes
  that 'batch' takes: with FSDP this all-gathers weights (and generated W(t)) for the
  matmuls, which is what FSDP means. Parameter shardings are fixed at creation and
  held by the step's output constraint, so they are unaffected.
  """
  table = dict(rules)
  batch = table.get("batch")
  taken = set((batch,) if isinstance(batch, str) else (batch or ()))
  out = []
  for name, target in rules:
    if name != "batch" and target is not None:
      targets = tuple(
        t for t in ((target,) if isinstance(target, str) else target) if t not in taken
      )
      target = None if not targets else (targets[0] if len(targets) == 1 else targets)
    out.append((name, target))
  return tuple(out)


def logical_to_spec(names: Sequence[str | None], rules) -> PartitionSpec:
  """PartitionSpec for logical `names` under `rules` (no context needed)."""
  table = dict(rules)
  return PartitionSpec(*(None if n is None else table[n] for n in names))


def batch_sharding(mesh: jax.sharding.Mesh, rules) -> NamedSharding:
  """Sharding of a [batch, length] array: batch split by the 'batch' rule."""
  return NamedSharding(mesh, logical_to_spec(("batch", None), rules))


def num_batch_shards(mesh: jax.sharding.Mesh, rules) -> int:
  """How many ways the batch axis is split (global batch must be a multiple)."""
  return mesh_axis_size(mesh, dict(rules)["batch"])


def global_batch_from_local(
  local_batch: Mapping[str, np.ndarray],
  sharding: NamedSharding,
  global_batch_size: int | None = None,
) -> dict:
  """Global jax.Arrays from this process's slice of the batch (multi-host safe).

  With `global_batch_size` the global shape is stated, so jax rejects process-local
  data that does not tile it instead of silently building a smaller "global" batch.
  """

  def make(v):
    v = np.asarray(v)
    shape = None if global_batch_size is None else (int(global_batch_size),) + v.shape[1:]
    return jax.make_array_from_process_local_data(sharding, v, global_shape=shape)

  return {k: make(v) for k, v in local_batch.items()}


def sharding_drift(state, shardings) -> list:
  """Paths whose array sharding differs from the expected `shardings` tree.

  Used by tests and debug checks: after a train step every parameter and optimizer
  leaf must keep exactly the sharding it was created with.
  """
  drift = []
  flat_state = jax.tree_util.tree_flatten_with_path(state)[0]
  flat_expected = jax.tree.leaves(shardings)
  for (path, x), expected in zip(flat_state, flat_expected):
    if not getattr(x, "sharding", None):
      continue
    if x.sharding != expected:
      drift.append((jax.tree_util.keystr(path), x.sharding, expected))
  return drift
