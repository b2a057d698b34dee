"""Mesh shapes and logical-axis rules (no devices needed beyond the host CPU)."""
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from odetransformer import sharding
from odetransformer.axes import LOGICAL_AXES


def test_mesh_shape_minus_one_takes_the_rest():
  assert sharding.resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
  assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  assert sharding.resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)


@pytest.mark.parametrize("shape,devices,words", [
    ((3, -1, 1), 8, "does not divide"),
    ((2, 2, 1), 8, "needs 4 devices"),
    ((-1, -1, 1), 8, "at most one"),
    ((1, 8), 8, "3 entries"),
])
def test_bad_mesh_shapes_are_one_line_errors(shape, devices, words):
  with pytest.raises(sharding.MeshError, match=words):
    sharding.resolve_mesh_shape(shape, devices)


def test_default_mesh_is_auto_and_covers_every_logical_axis():
  config = default.get_config()
  mesh = sharding.make_mesh(config.mesh)
  assert mesh.axis_names == sharding.MESH_AXES
  assert all(str(t).endswith("Auto") for t in mesh.axis_types)
  rules = dict(sharding.logical_axis_rules(config.mesh))
  assert set(LOGICAL_AXES) <= set(rules)
  assert rules["batch"] == ("data", "fsdp") and rules["embed"] == "fsdp"
  assert rules["heads"] == rules["mlp"] == rules["vocab"] == "tensor"
  assert rules["kv"] is None and rules["time_embed"] is None


def test_rules_overrides_from_config_strings():
  config = default.get_config()
  config.mesh.rules.embed = ""                 # replicate
  config.mesh.rules.batch = "data"
  config.mesh.rules.mlp = "fsdp,tensor"
  rules = dict(sharding.logical_axis_rules(config.mesh))
  assert rules["embed"] is None and rules["batch"] == "data"
  assert rules["mlp"] == ("fsdp", "tensor")
  assert sharding.logical_to_spec(("batch", "length", "mlp"), tuple(rules.items())) == \
      P("data", None, ("fsdp", "tensor"))


def test_unknown_mesh_axis_in_rules_is_an_error():
  config = default.get_config()
  config.mesh.rules.embed = "model"
  with pytest.raises(sharding.MeshError, match="unknown mesh axes"):
    sharding.logical_axis_rules(config.mesh)


def test_activation_rules_drop_the_batch_axes():
  rules = dict(sharding.activation_rules(sharding.DEFAULT_RULES))
  assert rules["batch"] == ("data", "fsdp")
  assert rules["embed"] is None               # fsdp is taken by the batch
  assert rules["heads"] == rules["vocab"] == "tensor"


def test_global_batch_rejects_local_data_that_does_not_tile_the_stated_global_shape():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sh = jax.sharding.NamedSharding(mesh, P("data"))
  local = {"inputs": np.zeros((4, 8), np.int32)}
  assert sharding.global_batch_from_local(local, sh, 4)["inputs"].shape == (4, 8)
  with pytest.raises(ValueError):   # this process's rows do not tile a batch of 8
    sharding.global_batch_from_local(local, sh, 8)
