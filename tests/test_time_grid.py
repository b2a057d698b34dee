"""Time grids: non-uniform solves against closed forms and a reference loop, the training
grid draw (model.train_time_grid) and its hook in the train step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from odetransformer import sharding as sharding_lib
from odetransformer import solvers, steps, time_grid
from odetransformer import config as config_lib
from odetransformer.config import ModelConfig
from odetransformer.losses import token_cross_entropy
from odetransformer.model import create_model
from test_model import (TINY, _np, _perturb_hypernet, linear_ode_problem, ref_field, ref_norm,
                        ref_weights, tokens)
from tiny import tiny_config


def _smooth_grid(k):
  """A non-uniform grid g(u) = (u + u²)/2 at u = j/K (steps from 1/(2K) to 3/(2K))."""
  u = np.arange(k + 1, dtype=np.float64) / k
  return (u + u * u) / 2


@pytest.mark.parametrize("method,order", [("euler", 1), ("midpoint", 2), ("rk4", 4)])
def test_solver_order_on_a_non_uniform_grid(method, order):
  """dx/dt = cos(t)·A0 x: x(1) = expm(sin(1)·A0) x0, reached at the method's order on a
  smoothly graded grid, with per-step step sizes scanned by the solver."""
  with jax.enable_x64(True):
    field, x0, exact = linear_ode_problem()
    errors = []
    for k in (8, 16, 32, 64):
      grid = _smooth_grid(k)
      nodes = np.asarray(solvers.STAGE_NODES[method])
      ts = grid[:-1, None] + np.diff(grid)[:, None] * nodes[None]  # stage times, by hand
      x1 = solvers.fixed_step_solve(field, x0, jnp.asarray(ts), jnp.asarray(np.diff(grid)),
                                    method)
      errors.append(np.linalg.norm(np.asarray(x1) - exact))
    rates = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    np.testing.assert_allclose(rates, order, atol=0.15)


def test_grid_stage_times_and_steps():
  grid = jnp.asarray([0.0, 0.1, 0.5, 1.0])
  ts, dts = solvers.grid_stage_times(grid, "rk4")
  np.testing.assert_allclose(np.asarray(dts), [0.1, 0.4, 0.5], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ts), [[0.0, 0.05, 0.1], [0.1, 0.3, 0.5],
                                              [0.5, 0.75, 1.0]], rtol=1e-6)


def test_bfloat16_state_stays_bfloat16_with_per_step_dt():
  x0 = jnp.ones((3,), jnp.bfloat16)
  x1 = solvers.fixed_step_solve(lambda x, t: -x, x0, jnp.zeros((2, 1)),
                                jnp.asarray([0.25, 0.75], jnp.float32), "euler", "full")
  assert x1.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(x1, np.float32), 0.75 * 0.25, rtol=1e-2)


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_model_on_a_time_grid_matches_a_reference_loop(flavour):
  """Step k of the model on a grid is x + dt_k·F(x, W(g_k)), dt_k = g_{k+1} - g_k: a plain
  Python loop with W(t) from the hypernetwork's raw params in float64."""
  cfg = dataclasses.replace(TINY, flavour=flavour)
  model = create_model(cfg, seed=11)
  _perturb_hypernet(model)
  toks = tokens(12, b=2, length=10)
  grid = np.array([0.0, 0.13, 0.38, 0.63, 1.0], np.float32)
  got = np.asarray(model(toks, time_grid=jnp.asarray(grid)))
  emb = _np(model.embed[...])
  want = []
  for b in range(toks.shape[0]):
    p = np.arange(toks.shape[1])
    x = emb[np.asarray(toks[b])] * cfg.embed_scale
    if flavour == "gpt":
      x = x + _np(model.pos_embed[...])[p]
    for k in range(len(grid) - 1):
      dt = np.float64(np.float32(grid[k + 1] - grid[k]))   # the model's float32 steps
      x = x + dt * ref_field(x, ref_weights(model, grid[k]), cfg, None, p)
    shift = _np(model.final_norm_shift[...]) if flavour == "gpt" else None
    x = ref_norm(x, _np(model.final_norm_scale[...]), shift, cfg.norm_eps)
    want.append(x @ emb.T)
  np.testing.assert_allclose(got, np.stack(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["diffeqformer", "shared"])
def test_uniform_grid_equals_num_steps(kind):
  cfg = dataclasses.replace(TINY, kind=kind)
  model = create_model(cfg, seed=4)
  _perturb_hypernet(model)
  toks = tokens(5)
  a = np.asarray(model(toks, num_steps=5))
  b = np.asarray(model(toks, time_grid=time_grid.uniform_grid(5)))
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_time_grid_is_checked():
  model = create_model(TINY, seed=0)
  toks = tokens()
  for bad in ([0.0, 0.6, 0.5, 1.0], [0.1, 0.5, 1.0], [0.0, 0.5, 0.9]):
    with pytest.raises(ValueError, match="must increase from 0 to 1"):
      model(toks, time_grid=jnp.asarray(bad))
  with pytest.raises(ValueError, match="disagree"):
    model(toks, num_steps=3, time_grid=time_grid.uniform_grid(4))
  with pytest.raises(ValueError, match="has no time"):
    create_model(dataclasses.replace(TINY, kind="gpt"), seed=0)(
        toks, time_grid=time_grid.uniform_grid(4))
  with pytest.raises(ValueError, match="train_time_grid='sometimes' is unknown"):
    ModelConfig(train_time_grid="sometimes")


def test_random_offset_grid_is_the_reference_scheme():
  """g = [0, dt0, dt0 + dt, …, dt0 + (K-2)·dt, 1] with dt0 ~ U(0, dt): interior steps
  are dt, the first dt0, the last 2·dt - dt0; over many draws dt0 fills (0, dt)."""
  k, dt = 6, 1.0 / 6
  offsets = []
  for i in range(400):
    g = np.asarray(time_grid.random_offset_grid(jax.random.key(i), k), np.float64)
    assert g.shape == (k + 1,) and g[0] == 0.0 and g[-1] == 1.0
    steps = np.diff(g)
    np.testing.assert_allclose(steps[1:-1], dt, rtol=1e-5)
    assert 0.0 <= steps[0] < dt and np.isclose(steps[-1], 2 * dt - steps[0], rtol=1e-5)
    offsets.append(steps[0] / dt)
  hist, _ = np.histogram(offsets, bins=4, range=(0.0, 1.0))
  assert hist.min() > 60, hist        # each quarter of (0, dt) holds ~100 of 400 draws


def test_train_time_grid_option():
  key = jax.random.key(3)
  ode = dataclasses.replace(TINY, num_steps=4)
  assert time_grid.train_time_grid(ode, key) is None
  on = dataclasses.replace(ode, train_time_grid="random_offset")
  np.testing.assert_array_equal(np.asarray(time_grid.train_time_grid(on, key)),
                                np.asarray(time_grid.random_offset_grid(key, 4)))
  # A discrete model's depth has no time: the GPT baseline of an ODE config ignores it.
  assert time_grid.train_time_grid(dataclasses.replace(on, kind="gpt"), key) is None


def test_train_step_solves_on_the_grid_drawn_from_its_rng():
  """The train step's loss is the model's loss on random_offset_grid(fold_in(rng,
  _GRID_STREAM), K), not on the uniform grid (both taken directly from the same params)."""
  c = tiny_config("/unused")
  c.model.train_time_grid = "random_offset"
  c.model.num_steps = 3
  cfg = config_lib.model_config(c, 64)
  mesh = sharding_lib.make_mesh(c.mesh)
  rules = sharding_lib.logical_axis_rules(c.mesh)
  rng = np.random.default_rng(2)
  batch = {"inputs": rng.integers(0, 64, (2, 16)).astype(np.int32),
           "targets": rng.integers(0, 64, (2, 16)).astype(np.int32),
           "weights": np.ones((2, 16), np.float32)}
  key = jax.random.key(7)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts, state = steps.init_train_state(cfg, optax.sgd(0.0), 0, mesh)
    model, optimizer = ts.merge(state)
    _perturb_hypernet(model, scale=3.0)   # a field that moves x, so grids differ in loss
    state = nnx.state({"model": model, "optimizer": optimizer})
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state["model"]))
    step = steps.make_train_step(ts, lambda s: 0.0, rules)
    _, m = step(state, batch, key)
  reference = create_model(cfg, seed=0)
  graphdef, ref_state = nnx.split(reference)
  nnx.replace_by_pure_dict(ref_state, params)
  reference = nnx.merge(graphdef, ref_state)

  def loss(grid):
    logits = reference(jnp.asarray(batch["inputs"]), time_grid=grid)
    s, w = token_cross_entropy(logits.astype(jnp.float32), jnp.asarray(batch["targets"]))
    return float(s / w)

  drawn = time_grid.random_offset_grid(jax.random.fold_in(key, steps._GRID_STREAM), 3)
  on_grid, uniform = loss(drawn), loss(time_grid.uniform_grid(3))
  got = float(m.loss.compute())
  assert abs(got - on_grid) <= 1e-5 * on_grid
  assert abs(uniform - on_grid) > 100 * abs(got - on_grid) + 1e-4, (uniform, on_grid, got)
