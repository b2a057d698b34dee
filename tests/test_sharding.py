"""Mesh shapes and logical-axis rules (no devices needed beyond the host CPU)."""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from configs import default
from odetransformer.model import config as config_lib
from odetransformer.model.axes import LOGICAL_AXES
from odetransformer.model.blocks import layer_param_specs
from odetransformer.model.transformer import create_model
from odetransformer.train import sharding, steps

from tiny import run_on_8_cpu_devices, tiny_config


def test_mesh_shape_minus_one_takes_the_rest():
  assert sharding.resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
  assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
  assert sharding.resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)


@pytest.mark.parametrize(
  "shape,devices,words",
  [
    ((3, -1, 1), 8, "does not divide"),
    ((2, 2, 1), 8, "needs 4 devices"),
    ((-1, -1, 1), 8, "at most one"),
    ((1, 8), 8, "3 entries"),
  ],
)
def test_bad_mesh_shapes_are_one_line_errors(shape, devices, words):
  with pytest.raises(sharding.MeshError, match=words):
    sharding.resolve_mesh_shape(shape, devices)


def test_default_mesh_is_auto_and_covers_every_logical_axis():
  config = default.get_config()
  mesh = sharding.make_mesh(config.mesh)
  assert mesh.axis_names == sharding.MESH_AXES
  assert all(str(t).endswith("Auto") for t in mesh.axis_types)
  rules = dict(sharding.logical_axis_rules(config.mesh.rules))
  assert set(LOGICAL_AXES) <= set(rules)
  assert rules["batch"] == ("data", "fsdp") and rules["embed"] == "fsdp"
  assert rules["heads"] == rules["mlp"] == rules["vocab"] == "tensor"
  assert rules["kv"] is None and rules["time_embed"] is None


def test_rules_overrides_from_config_strings():
  config = default.get_config()
  config.mesh.rules.embed = ""  # replicate
  config.mesh.rules.batch = "data"
  config.mesh.rules.mlp = "fsdp,tensor"
  rules = dict(sharding.logical_axis_rules(config.mesh.rules))
  assert rules["embed"] is None and rules["batch"] == "data"
  assert rules["mlp"] == ("fsdp", "tensor")
  assert sharding.logical_to_spec(("batch", "length", "mlp"), tuple(rules.items())) == P(
    "data", None, ("fsdp", "tensor")
  )


def test_unknown_mesh_axis_in_rules_is_an_error():
  config = default.get_config()
  config.mesh.rules.embed = "model"
  with pytest.raises(sharding.MeshError, match="unknown mesh axes"):
    sharding.logical_axis_rules(config.mesh.rules)


def test_activation_rules_drop_the_batch_axes():
  rules = dict(sharding.activation_rules(sharding.DEFAULT_RULES))
  assert rules["batch"] == ("data", "fsdp")
  assert rules["embed"] is None  # fsdp is taken by the batch
  assert rules["heads"] == rules["vocab"] == "tensor"


def _constraint_specs(jaxpr) -> list:
  """The PartitionSpec of every sharding constraint in `jaxpr` and its sub-jaxprs."""
  specs = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sharding_constraint":
      specs.append(tuple(eqn.params["sharding"].spec))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          specs += _constraint_specs(inner)
  return specs


def test_generated_weights_follow_the_parameter_rules_activations_the_rules_in_force():
  """A DiffEqFormer step traced under the activation rules (embed not split: fsdp splits
  the batch): each generated W(t) is constrained by the parameter rules the step passes
  (embed on fsdp, where its P lives), every activation as before; without them W
  follows the rules in force."""
  c = tiny_config("/unused")
  cfg = config_lib.model_config(c, 64)
  rules = sharding.logical_axis_rules(c.mesh.rules)
  mesh = jax.sharding.AbstractMesh(
    (1, 2, 1), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  graphdef, state = nnx.split(create_model(cfg))
  batch = {"inputs": jnp.zeros((2, 8), jnp.int32)}

  def specs(param_rules):
    def logits(s):
      return steps._logits(nnx.merge(graphdef, s), batch, param_rules)

    with (
      jax.sharding.use_abstract_mesh(mesh),
      nnx.logical_axis_rules(sharding.activation_rules(rules)),
    ):
      return _constraint_specs(jax.make_jaxpr(logits)(state).jaxpr)

  passed, in_force = specs(rules), specs(None)
  embed_weights = [s for s in layer_param_specs(cfg).values() if "embed" in s.axes]
  generated = [s for s in passed if "fsdp" in s[1:]]  # fsdp elsewhere than the batch
  assert len(generated) == len(embed_weights) > 0, passed
  assert len(passed) == len(in_force)
  for p, f in zip(passed, in_force):
    if p in generated:  # W [K·S, *weight axes]: the same, but embed on fsdp
      assert p[0] is None and f == tuple(None if a == "fsdp" else a for a in p), (p, f)
    else:  # an activation: as before
      assert p == f


def test_global_batch_rejects_local_data_that_does_not_tile_the_stated_global_shape():
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sh = jax.sharding.NamedSharding(mesh, P("data"))
  local = {"inputs": np.zeros((4, 8), np.int32)}
  assert sharding.global_batch_from_local(local, sh, 4)["inputs"].shape == (4, 8)
  with pytest.raises(ValueError):  # this process's rows do not tile a batch of 8
    sharding.global_batch_from_local(local, sh, 8)


# The two tests below compare runs on 8 host CPU devices with 1-device ones, in one
# process (`on_8_devices`): each script runs there in a namespace of its own and leaves
# its results in `result`. The 2x2x2 script also leaves the parameters its 1-device run
# created (`created_model`), which the equality script's DiffEqFormer starts from: the
# same model config and seed, so one init program fewer to compile.
_SHARDED_SCRIPT = r"""
import json, sys
import jax, numpy as np
from flax import nnx
from tiny import tiny_config
from odetransformer.model import config as config_lib
from odetransformer.train import optimizer, sharding, steps
assert jax.device_count() == 8, jax.devices()

c = tiny_config("/unused")
c.model.num_heads = 4                       # split over tensor=2
cfg = config_lib.model_config(c, 64)
tx = optimizer.create_optimizer(c.optim, 10)
sched = optimizer.learning_rate_schedule(c.optim, 10)
rng = np.random.default_rng(0)
batches = [{"inputs": rng.integers(0, 64, (8, 32)).astype(np.int32),
            "targets": rng.integers(0, 64, (8, 32)).astype(np.int32),
            "segment_ids": np.ones((8, 32), np.int32),
            "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
            "weights": np.ones((8, 32), np.float32)} for _ in range(4)]

def run(shape, devices):
  c.mesh.shape = shape
  mesh = sharding.make_mesh(c.mesh, devices)
  rules = sharding.logical_axis_rules(c.mesh.rules)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts, state = steps.init_train_state(cfg, tx, 0, mesh)
    created = [np.asarray(x) for x in jax.tree.leaves(state["model"])]
    step = steps.make_train_step(ts, sched, rules)
    bsh = sharding.batch_sharding(mesh, rules)
    losses = []
    for i, b in enumerate(batches):
      state, m = step(state, sharding.global_batch_from_local(b, bsh), jax.random.key(i))
      losses.append(float(m.loss.compute()))
    drift = sharding.sharding_drift(state, ts.shardings)
    specs = {jax.tree_util.keystr(p): str(x.sharding.spec)
             for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  return losses, [d[0] for d in drift], specs, created

one = run((1, 1, 1), jax.devices()[:1])
eight = run((2, 2, -1), jax.devices())
result = {"one": one[0], "eight": eight[0], "drift": eight[1], "specs": eight[2]}
created_model = one[3]   # the equality script's ode_gpt model: the same config and seed
"""


_EQUALITY_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from tiny import tiny_config
from odetransformer.train import sharding, steps
from odetransformer.model import config as config_lib
assert jax.device_count() == 8, jax.devices()

# A stand-in optimizer whose state is the gradient it was given (and no update): the
# real train step then hands back its exact float32 gradient, sharded as the params.
capture = optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), updates))

# The ODE cases train with the local error on every row: 8 rows over 8 batch shards leave
# one row a shard, where a stride s > 1 picks other rows than one device's (every s-th of
# 8; setup says so). test_local_error_stride_picks_rows_within_each_batch_shard checks s.
EVERY_ROW = {"local_error_stride": 1}
CASES = {
    "ode_gpt": EVERY_ROW,
    # Continuous fine-tuning (the same hypernetworks at another step count and solver),
    # on the llama family: its blocks (RMSNorm, RoPE, SwiGLU) on every mesh too.
    "continuous_llama": {"family": "llama", "solver_steps": 3, "solver": "midpoint", **EVERY_ROW},
    # LoRA fine-tuning of a materialised ODE: frozen parallel layers plus adapters.
    "lora": {"kind": "parallel", "lora_rank": 2, "lora_targets": "wq,wo,w1"},
}
# The parameters of the ode_gpt model at creation, as host arrays in the order of its state's
# leaves, when the runner hands them over (the 2x2x2 script's); else created here.
created_model = globals().get("created_model")
# The eval step too, where the weights are generated (its compilations cost time).
EVAL_CASES = ("ode_gpt",)
rng = np.random.default_rng(0)
batch = {"inputs": rng.integers(0, 64, (8, 32)).astype(np.int32),
         "targets": rng.integers(0, 64, (8, 32)).astype(np.int32),
         "segment_ids": np.repeat([[1] * 20 + [2] * 12], 8, 0).astype(np.int32),
         "positions": np.repeat([list(range(20)) + list(range(12))], 8, 0).astype(np.int32),
         "weights": (rng.random((8, 32)) > 0.2).astype(np.float32)}

def run(name, shape, devices, start=None):
  # (loss, grad norm, gradients, eval loss) of one train step and one eval step on
  # `shape`, and the host state they began from: `start`, or (None) a created state
  # moved off its initial values.
  c = tiny_config("/unused")
  c.model.num_heads = 4                       # split over tensor = 4
  for key, value in CASES[name].items():
    c.model[key] = value
  c.mesh.shape = shape
  cfg = config_lib.model_config(c, 64)
  mesh = sharding.make_mesh(c.mesh, devices)
  rules = sharding.logical_axis_rules(c.mesh.rules)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    if start is None:
      if name == "ode_gpt" and created_model is not None:
        # The 2x2x2 script created this model (its 1-device run): its parameters, and the
        # zeros that `capture` and the step counter start from, without another init.
        ts = steps.state_layout(cfg, capture, 0, mesh)
        rest = jax.tree.leaves(ts.abstract)[len(created_model):]
        state = ts.assemble(created_model, [np.zeros(a.shape, a.dtype) for a in rest])
      else:
        ts, state = steps.init_train_state(cfg, capture, 0, mesh)
      # Move every parameter off its initial value (zero-initialised generators, LoRA's
      # B) by host-made noise, so that every gradient is non-zero.
      noise = np.random.default_rng(1)
      leaves, tree = jax.tree.flatten(state)
      start = jax.tree.unflatten(tree, [
          np.asarray(x) + 0.05 * noise.standard_normal(x.shape).astype(x.dtype)
          if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x) for x in leaves])
    else:                # every mesh starts from the same values, in its own shardings
      ts = steps.state_layout(cfg, capture, 0, mesh)
    state = jax.device_put(start, ts.shardings)
    step = steps.make_train_step(ts, lambda s: 1.0, rules)
    bsh = sharding.batch_sharding(mesh, rules)
    gbatch = sharding.global_batch_from_local(batch, bsh)
    eval_loss = None
    if name in EVAL_CASES:
      eval_loss = float(steps.make_eval_step(ts, rules)(state, gbatch).loss.compute())
    state, m = step(state, gbatch, jax.random.key(0))
    grads = {jax.tree_util.keystr(p): np.asarray(x).tolist()
             for p, x in jax.tree_util.tree_flatten_with_path(
                 nnx.to_pure_dict(state["optimizer"]))[0] if np.asarray(x).ndim > 0}
  return (float(m.loss.compute()), float(m.grad_norm.compute()), grads, eval_loss), start

out = {}
for name in CASES:
  one, start = run(name, (1, 1, 1), jax.devices()[:1])
  out[name] = {"one": one}
  # The fine-tuning cases on the two meshes that use all three axes (compiles cost time).
  for shape in ((1, 8, 1), (2, 4, 1), (1, 2, 4)) if name == "ode_gpt" else ((2, 4, 1), (1, 2, 4)):
    out[name][str(shape)] = run(name, shape, jax.devices(), start)[0]
result = out
"""


_SEPARATOR = "---- end of the 2x2x2 script ----"
_RUNNER = f"""
import json, sys

def run(name, script, **given):
  namespace = {{"__name__": name, **given}}
  exec(compile(script, name, "exec"), namespace)
  return namespace

sharded = run("sharded_2x2x2", {_SHARDED_SCRIPT!r})
print({_SEPARATOR!r}, file=sys.stderr, flush=True)
equality = run("equality", {_EQUALITY_SCRIPT!r}, created_model=sharded["created_model"])
print(json.dumps({{"sharded_2x2x2": sharded["result"], "equality": equality["result"]}}))
"""
# Both tests use it: under pytest-xdist they run on one worker, the process started once.
ON_8_DEVICES = pytest.mark.xdist_group("test_sharding_8_devices")


@pytest.fixture(scope="module")
def on_8_devices(tmp_path_factory):
  """One process on 8 host CPU devices (default PRNG) runs both scripts: their results,
  and what the 2x2x2 script wrote to stderr (XLA's warnings included)."""
  out, stderr = run_on_8_cpu_devices(_RUNNER, tmp_path_factory.mktemp("on_8_devices"), timeout=1800)
  assert _SEPARATOR in stderr, stderr[-3000:]
  return out, stderr.split(_SEPARATOR)[0]


@pytest.mark.slow
@ON_8_DEVICES
def test_sharded_2x2x2_matches_one_device_and_keeps_shardings(on_8_devices):
  out, stderr = on_8_devices[0]["sharded_2x2x2"], on_8_devices[1]
  np.testing.assert_allclose(out["eight"][0], out["one"][0], rtol=1e-5)  # first step
  np.testing.assert_allclose(out["eight"], out["one"], rtol=1e-4)  # and after
  assert out["drift"] == []
  # The SPMD partitioner never falls back to replicating a whole tensor (it warns when it
  # does: the embedding lookup once all-gathered the global batch's activations).
  assert "Involuntary full rematerialization" not in stderr, stderr[-3000:]
  specs = out["specs"]
  # Params really are split: embedding over (tensor, fsdp), Adam moments alike.
  assert specs["['model']['embed'].value"] == "P('tensor', 'fsdp')"
  mu = [v for k, v in specs.items() if "'mu'" in k and "'embed'" in k]
  assert mu == ["P('tensor', 'fsdp')"]


@pytest.mark.slow
@ON_8_DEVICES
def test_loss_and_gradients_on_8_device_meshes_equal_one_device(on_8_devices):
  """DiffEqFormer (both families), continuous and LoRA fine-tuning: the real
  train step's loss, gradient norm and every gradient, and (DiffEqFormer) the eval
  step's loss, on the (1,8,1), (2,4,1), (1,2,4) meshes (the fine-tuning cases on the
  last two) equal the 1-device ones to float32 rounding (sums in another order)."""
  out = on_8_devices[0]["equality"]
  assert set(out) == {"ode_gpt", "continuous_llama", "lora"}
  for name, runs in out.items():
    loss, norm, grads, eval_loss = runs.pop("one")
    assert norm > 0, name
    if name == "lora":  # only the adapters train: A and B of wq, wo, w1
      assert len(grads) == 6 and all("lora" in key for key in grads), sorted(grads)
    else:
      assert len(grads) >= 8, (name, sorted(grads))
    assert len(runs) == (3 if name == "ode_gpt" else 2), (name, sorted(runs))
    if name == "ode_gpt":
      # The eval step's loss is the train step's (no dropout, the uniform time grid).
      np.testing.assert_allclose(eval_loss, loss, rtol=1e-6, err_msg=name)
    for mesh, (loss8, norm8, grads8, eval_loss8) in runs.items():
      np.testing.assert_allclose(loss8, loss, rtol=1e-6, err_msg=f"{name} {mesh}")
      if name == "ode_gpt":
        np.testing.assert_allclose(eval_loss8, eval_loss, rtol=1e-6, err_msg=f"{name} {mesh}")
      np.testing.assert_allclose(norm8, norm, rtol=1e-5, err_msg=f"{name} {mesh}")
      assert grads8.keys() == grads.keys()
      largest = max(np.max(np.abs(g)) for g in grads.values())
      for key, g in grads.items():
        g, g8 = np.asarray(g), np.asarray(grads8[key])
        if "['bk']" in key:
          # Zero in exact arithmetic (softmax ignores a shift along the keys): what is
          # there is rounding, which differs between programs; bounded, not compared.
          assert np.max(np.abs(g8)) <= 1e-5 * largest, (name, mesh, key)
          continue
        assert np.any(g != 0), (name, key)
        # float32 sums taken in another order: a few ulps of the largest entry.
        np.testing.assert_allclose(
          g8, g, rtol=1e-4, atol=1e-6 * np.max(np.abs(g)), err_msg=f"{name} {mesh} {key}"
        )


_STRIDE_SCRIPT = r"""
import json
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from tiny import tiny_config
from odetransformer.model import config as config_lib
from odetransformer.model.transformer import create_model
from odetransformer.train import sharding
assert jax.device_count() == 8, jax.devices()

c = tiny_config("/unused")
base = dataclasses.replace(config_lib.model_config(c, 64), solver_steps=2)
toks = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
out = {}
for shape, stride in (((1, 1, 1), 4), ((1, 1, 1), 1), ((2, 1, 4), 4), ((8, 1, 1), 4)):
  c.mesh.shape = shape
  devices = jax.devices()[: int(np.prod(shape))]
  mesh = sharding.make_mesh(c.mesh, devices)
  rules = sharding.logical_axis_rules(c.mesh.rules)
  for form in ("steps", "halves"):  # 'halves': step j = 1's, j traced as the train step's
    cfg = dataclasses.replace(base, local_error_stride=stride, local_error_form=form)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      model = create_model(cfg, seed=0)
      x = jax.device_put(toks, sharding.batch_sharding(mesh, rules))
    # Traced as the train step is: activation rules, the weights made by the param rules.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.activation_rules(rules)):
      j = None if form == "steps" else jnp.int32(1)
      def run(m, t, j):
        return m(t, param_rules=rules, return_local_error=True, local_error_step=j)[1]
      error = jax.jit(run)(model, x, j)
    out[f"{shape} {stride} {form}"] = float(error)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_local_error_stride_picks_rows_within_each_batch_shard(tmp_path):
  """model.local_error_stride s on a mesh: 8 rows over 2 batch shards (4 a shard) at s = 4
  give the one-device error of rows 0 and 4; over 8 shards (1 a shard) every row's, as
  stride 1 (rows never leave their device: gcd(s, 1) = 1). No involuntary
  rematerialisation either way. The same for local_error_form='halves' (one step's)."""
  out, stderr = run_on_8_cpu_devices(_STRIDE_SCRIPT, tmp_path, timeout=900)
  for form in ("steps", "halves"):
    one_4, one_1 = out[f"(1, 1, 1) 4 {form}"], out[f"(1, 1, 1) 1 {form}"]
    assert abs(one_4 - one_1) > 1e-3 * one_1  # the strided error is another estimate
    np.testing.assert_allclose(out[f"(2, 1, 4) 4 {form}"], one_4, rtol=1e-5)
    np.testing.assert_allclose(out[f"(8, 1, 1) 4 {form}"], one_1, rtol=1e-5)
  assert "Involuntary full rematerialization" not in stderr, stderr[-3000:]
