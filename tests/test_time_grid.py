"""Time grids: non-uniform solves against closed forms and a reference loop, the training
grid draw (model.train_time_grid) and its hook in the train step."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_model import (
  TINY,
  _np,
  _perturb_hypernet,
  linear_ode_problem,
  ref_field,
  ref_norm,
  ref_weights,
  tokens,
)

from odetransformer.model import config as config_lib
from odetransformer.model import solvers, time_grid
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import create_model
from odetransformer.train import sharding as sharding_lib
from odetransformer.train import steps
from odetransformer.train.checkpoint.fingerprint import fingerprint, fingerprint_diffs
from odetransformer.train.losses import token_cross_entropy

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
      x1 = solvers.fixed_step_solve(field, x0, jnp.asarray(ts), jnp.asarray(np.diff(grid)), method)
      errors.append(np.linalg.norm(np.asarray(x1) - exact))
    rates = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    np.testing.assert_allclose(rates, order, atol=0.15)


def test_grid_stage_times_and_steps():
  grid = jnp.asarray([0.0, 0.1, 0.5, 1.0])
  ts, dts = solvers.grid_stage_times(grid, "rk4")
  np.testing.assert_allclose(np.asarray(dts), [0.1, 0.4, 0.5], rtol=1e-6)
  np.testing.assert_allclose(
    np.asarray(ts), [[0.0, 0.05, 0.1], [0.1, 0.3, 0.5], [0.5, 0.75, 1.0]], rtol=1e-6
  )


def test_bfloat16_state_stays_bfloat16_with_per_step_dt():
  x0 = jnp.ones((3,), jnp.bfloat16)
  x1 = solvers.fixed_step_solve(
    lambda x, t: -x, x0, jnp.zeros((2, 1)), jnp.asarray([0.25, 0.75], jnp.float32), "euler", "full"
  )
  assert x1.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(x1, np.float32), 0.75 * 0.25, rtol=1e-2)


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize(
  "family,step_time", [("gpt2", "start"), ("llama", "start"), ("llama", "end")]
)
def test_model_on_a_time_grid_matches_a_reference_loop(family, step_time):
  """Step k of the model on a grid is x + dt_k·F(x, W(g_k)) (W(g_{k+1}) at step_time
  'end'), dt_k = g_{k+1} - g_k: a plain Python loop with W(t) from the hypernetwork's
  raw params in float64."""
  cfg = dataclasses.replace(TINY, family=family, step_time=step_time)
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
    if family == "gpt2":
      x = x + _np(model.pos_embed[...])[p]
    for k in range(len(grid) - 1):
      dt = np.float64(np.float32(grid[k + 1] - grid[k]))  # the model's float32 steps
      t = grid[k + 1] if step_time == "end" else grid[k]
      x = x + dt * ref_field(x, ref_weights(model, t), cfg, None, p)
    shift = _np(model.final_norm_shift[...]) if family == "gpt2" else None
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
    create_model(dataclasses.replace(TINY, kind="transformer"), seed=0)(
      toks, time_grid=time_grid.uniform_grid(4)
    )
  with pytest.raises(ValueError, match="train_time_grid='sometimes' is unknown"):
    ModelConfig(train_time_grid="sometimes")


def _draws(max_offset, k=4, n=400):
  keys = jax.random.split(jax.random.key(0), n)
  return np.asarray(
    jax.vmap(lambda key: time_grid.random_offset_grid(key, k, max_offset))(keys), np.float64
  )


def test_random_offset_grid_is_the_reference_scheme():
  """qkvflow's `generate_t` draws dt0 ~ U(0, dt) and evaluates step k at its end,
  t = [dt0, dt0 + dt, …, dt0 + (K-2)·dt, 1] with steps [dt0, dt, …, dt, 1 - t_{K-2}]:
  exactly the step ends and steps of `random_offset_grid`. What it trains, under either
  step time, never reaches [(K-1)/K, 1) (Euler evaluates g_0…g_{K-1} or g_1…g_K)."""
  k, dt = 4, 0.25
  grids = _draws(1.0, k)
  for g in grids:
    dt0 = g[1]
    t_ref = np.concatenate([dt0 + dt * np.arange(k - 1), [1.0]])
    dts_ref = np.diff(np.concatenate([[0.0], t_ref]))
    np.testing.assert_allclose(g[1:], t_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.diff(g), dts_ref, rtol=1e-4, atol=1e-7)
  hist, _ = np.histogram(grids[:, 1] / dt, bins=4, range=(0.0, 1.0))
  assert hist.min() > 60, hist  # each quarter of (0, dt) holds ~100 of 400 draws
  for step_time in ("start", "end"):
    evaluated = np.asarray(
      jax.vmap(lambda g, s=step_time: solvers.grid_stage_times(g, "euler", s)[0])(grids)
    )
    assert not np.any((evaluated >= (k - 1) / k) & (evaluated < 1.0)), step_time


@pytest.mark.parametrize("method", ["euler", "midpoint", "rk4"])
@pytest.mark.parametrize("step_time", ["start", "end"])
@pytest.mark.parametrize("grid_name", ["random_shift", "random_uniform"])
def test_random_grids_train_every_time_a_solve_evaluates(grid_name, step_time, method):
  """Over 400 batches of K = 4, the times the solver evaluates (its stage times on each
  drawn grid) fall in every one of 64 equal bins of [0, 1], so every t that a solve at
  another N evaluates — [0, 1) at 'start', (0, 1] at 'end' — lies within 1/64 of a
  trained one; the grids are valid (0 = g_0 <= … <= g_K = 1)."""
  cfg = dataclasses.replace(
    TINY,
    solver_steps=4,
    num_layers=4,
    train_time_grid=grid_name,
    step_time=step_time,
    solver=method,
  )
  keys = jax.random.split(jax.random.key(1), 400)
  grids = jax.vmap(lambda key: time_grid.train_time_grid(cfg, key))(keys)
  g = np.asarray(grids, np.float64)
  assert (g[:, 0] == 0).all() and (g[:, -1] == 1).all() and (np.diff(g, axis=1) >= 0).all()
  ts = np.asarray(
    jax.vmap(lambda grid: solvers.grid_stage_times(grid, method, step_time)[0])(grids), np.float64
  ).ravel()
  assert ts.min() >= 0.0 and ts.max() <= 1.0
  hist, _ = np.histogram(ts, bins=64, range=(0.0, 1.0))
  assert hist.min() > 0, np.flatnonzero(hist == 0) / 64


def test_train_time_grid_option():
  key = jax.random.key(3)
  ode = dataclasses.replace(TINY, solver_steps=4, num_layers=4)
  assert time_grid.train_time_grid(ode, key) is None
  on = dataclasses.replace(ode, train_time_grid="random_offset")
  np.testing.assert_array_equal(
    np.asarray(time_grid.train_time_grid(on, key)), np.asarray(time_grid.random_offset_grid(key, 4))
  )
  shift = dataclasses.replace(ode, train_time_grid="random_shift")
  np.testing.assert_array_equal(
    np.asarray(time_grid.train_time_grid(shift, key)),
    np.asarray(time_grid.random_offset_grid(key, 4, 2.0)),
  )
  # A discrete model's depth has no time: the GPT baseline of an ODE config ignores it.
  assert time_grid.train_time_grid(dataclasses.replace(on, kind="transformer"), key) is None


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_a_fraction_of_batches_draws_the_random_grid(fraction):
  """train_time_grid_fraction p: a batch's grid is the option's random grid with
  probability p, else exactly the uniform grid; over 2,000 keys the share of random
  grids is p within 4.5 standard deviations of a binomial."""
  cfg = dataclasses.replace(
    TINY,
    solver_steps=4,
    num_layers=4,
    train_time_grid="random_shift",
    train_time_grid_fraction=fraction,
  )
  keys = jax.random.split(jax.random.key(0), 2000)
  grids = np.asarray(jax.vmap(lambda k: time_grid.train_time_grid(cfg, k))(keys))
  uniform = np.asarray(time_grid.uniform_grid(4))
  is_uniform = np.all(grids == uniform, axis=1)
  n = len(keys)
  assert abs((~is_uniform).mean() - fraction) <= 4.5 * np.sqrt(fraction * (1 - fraction) / n)
  for key, grid in zip(keys[~is_uniform][:20], grids[~is_uniform][:20]):  # the option's grid
    grid_key, _ = jax.random.split(key)
    np.testing.assert_array_equal(grid, np.asarray(time_grid.random_offset_grid(grid_key, 4, 2.0)))
  with pytest.raises(ValueError, match="train_time_grid_fraction=0.0 must be in"):
    dataclasses.replace(cfg, train_time_grid_fraction=0.0)


def _tanh_problem(seed, rows, k, grid):
  """dx/dt = tanh(x·Aᵀ)·(1 + t) on a uniform or a non-uniform ('smooth') grid of K steps:
  (x0, grid g, stage times, step sizes in float64, the field in float32 for the solver and
  in float64 for the reference, the solver's dt)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(3, 3)) * 0.8
  x0 = rng.normal(size=(rows, 3)).astype(np.float32)
  g = _smooth_grid(k) if grid else np.arange(k + 1) / k
  ts, dts = np.asarray(g[:-1], np.float32), np.diff(np.asarray(g, np.float64))
  field = lambda x, t: jnp.tanh(x @ a.T.astype(np.float32)) * (1.0 + t)  # noqa: E731
  f = lambda x, t: np.tanh(x @ a.T) * (1.0 + t)  # noqa: E731
  dt = jnp.asarray(dts, jnp.float32) if grid else 1.0 / k
  return x0, g, ts, dts, field, f, dt


@pytest.mark.parametrize("boundary", [None, "end", "start"])
@pytest.mark.parametrize("grid", [None, "smooth"])
def test_local_error_is_the_heun_minus_euler_step(grid, boundary):
  """local_error=True: Σ_k mean(e_k²) with e_k Heun's step from x_{k-1} minus Euler's,
  dt_{k-1}/2·(F(x_k, t_k) − F(x_{k-1}, t_{k-1})), the F evaluated here from the field
  itself (not from the trajectory's differences), on a uniform and a non-uniform grid.
  With boundary inputs (a time t_b): 'end' adds the last step's, dt_(K-1)/2·(F(x_K, t_b)
  − F(x_(K-1), t_(K-1))); 'start' adds dt_0/2·(F(x_0, t_0) − F(x_0, t_b))."""
  k = 6
  x0, g, ts, dts, field, f, dt = _tanh_problem(5, 2, k, grid)
  t_b = 1.0 if boundary == "end" else 0.3
  x_k, traj, error = solvers.fixed_step_solve(
    field,
    jnp.asarray(x0),
    jnp.asarray(ts)[:, None],
    dt,
    return_trajectory=True,
    local_error=True,
    boundary_inputs=None if boundary is None else jnp.full((1, 1), t_b, jnp.float32),
    boundary=boundary or "end",
  )
  xs = np.concatenate([np.asarray(traj, np.float64), np.asarray(x_k, np.float64)[None]])
  terms = [dts[j - 1] / 2 * (f(xs[j], ts[j]) - f(xs[j - 1], ts[j - 1])) for j in range(1, k)]
  if boundary == "end":
    terms.append(dts[-1] / 2 * (f(xs[k], t_b) - f(xs[k - 1], ts[k - 1])))
  elif boundary == "start":
    terms.append(dts[0] / 2 * (f(xs[0], ts[0]) - f(xs[0], t_b)))
  want = sum(np.mean(e**2) for e in terms)
  np.testing.assert_allclose(float(error), want, rtol=2e-4)
  plain = solvers.fixed_step_solve(field, jnp.asarray(x0), jnp.asarray(ts)[:, None], dt)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(x_k))  # the solve is the same


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("step_time", ["start", "end"])
def test_model_local_error_counts_every_step(step_time):
  """The model's local error, from a float64 reference field on its own trajectory: Euler's
  K − 1 second differences plus the step the solve never closes, through the field at the
  time it never evaluates (t = 1 under 'start': the last step's Heun–Euler error; t = 0
  under 'end': the first's)."""
  cfg = dataclasses.replace(
    TINY, solver_steps=3, num_layers=3, step_time=step_time, local_error_form="steps"
  )
  model = create_model(cfg, seed=0)
  _perturb_hypernet(model, scale=3.0)  # a field that moves x: a non-zero local error
  toks = tokens(3, b=1, length=8)
  _, traj, error = model(toks, return_trajectory=True, return_local_error=True)
  k, dt = cfg.solver_steps, 1.0 / cfg.solver_steps
  x = np.asarray(traj, np.float64)[:, 0]  # [K, t, d], the states before each step
  seg, pos = np.zeros(8, np.int32), np.arange(8)
  node = (lambda j: j * dt) if step_time == "start" else (lambda j: (j + 1) * dt)
  slopes = [ref_field(x[j], ref_weights(model, node(j)), cfg, seg, pos) for j in range(k)]
  x_k = x[-1] + dt * slopes[-1]  # x_K, in the reference's float64
  terms = [dt / 2 * (slopes[j] - slopes[j - 1]) for j in range(1, k)]
  if step_time == "start":
    closing = ref_field(x_k, ref_weights(model, 1.0), cfg, seg, pos)
    terms.append(dt / 2 * (closing - slopes[-1]))
  else:
    opening = ref_field(x[0], ref_weights(model, 0.0), cfg, seg, pos)
    terms.append(dt / 2 * (slopes[0] - opening))
  want = sum(np.mean(e**2) for e in terms)
  np.testing.assert_allclose(float(error), want, rtol=1e-3)


@pytest.mark.parametrize("grid", [None, "smooth"])
def test_halves_error_is_two_euler_halves_minus_the_step(grid):
  """error_step j: K·mean(d_j²), d_j the two Euler half steps of step j (the second at
  t_j + dt_j/2, from the first's end) minus its one Euler step, both from the solve's own
  x_j, computed here in float64 from the field itself; on a uniform and a non-uniform
  grid, on every 2nd row, and for every j: a uniform j's mean is the sum over steps."""
  k = 5
  x0, g, ts, dts, field, f, dt = _tanh_problem(7, 4, k, grid)
  plain, traj = solvers.fixed_step_solve(
    field, jnp.asarray(x0), jnp.asarray(ts)[:, None], dt, return_trajectory=True
  )
  xs = np.asarray(traj, np.float64)[:, ::2]  # the error's rows
  for j in range(k):
    t_mid = g[j] + dts[j] / 2
    x_k, error = solvers.fixed_step_solve(
      field,
      jnp.asarray(x0),
      jnp.asarray(ts)[:, None],
      dt,
      local_error=True,
      error_stride=2,
      error_nodes=False,
      error_step=jnp.int32(j),
      halves_inputs=jnp.full((1, 1), t_mid, jnp.float32),
    )
    half = xs[j] + dts[j] / 2 * f(xs[j], g[j])
    halves = half + dts[j] / 2 * f(half, t_mid)
    whole = xs[j] + dts[j] * f(xs[j], g[j])
    np.testing.assert_allclose(float(error), k * np.mean((halves - whole) ** 2), rtol=2e-4)
    np.testing.assert_array_equal(np.asarray(x_k), np.asarray(plain))  # the solve is the same


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("form", ["halves", "both"])
@pytest.mark.parametrize("step_time", ["start", "end"])
def test_model_halves_error_reads_the_field_between_the_nodes(step_time, form):
  """model.local_error_form='halves' at step j: K·mean(d_j²), d_j = dt/2·(f(x_j + dt/2·F_j,
  W(t_j + dt/2)) − F_j) from a float64 reference field on the model's own x_j, F_j step j's
  slope (the field at t_j under 'start', t_(j+1) under 'end'); 'both': that plus the
  'steps' error (test_model_local_error_counts_every_step); the same logits as without
  the error, and an error without local_error_step is refused."""
  cfg = dataclasses.replace(
    TINY, solver_steps=3, num_layers=3, step_time=step_time, local_error_form=form
  )
  model = create_model(cfg, seed=0)
  _perturb_hypernet(model, scale=3.0)
  nodes = nnx.merge(*nnx.split(model))
  nodes.config = dataclasses.replace(cfg, local_error_form="steps")
  toks = tokens(3, b=1, length=8)
  k, dt = cfg.solver_steps, 1.0 / cfg.solver_steps
  seg, pos = np.zeros(8, np.int32), np.arange(8)
  plain = model(toks)
  for j in range(k):
    logits, traj, error = model(
      toks, return_trajectory=True, return_local_error=True, local_error_step=j
    )
    x = np.asarray(traj, np.float64)[j, 0]
    node = j * dt if step_time == "start" else (j + 1) * dt
    slope = ref_field(x, ref_weights(model, node), cfg, seg, pos)
    mid = ref_field(x + dt / 2 * slope, ref_weights(model, (j + 0.5) * dt), cfg, seg, pos)
    want = k * np.mean((dt / 2 * (mid - slope)) ** 2)
    if form == "both":
      want += float(nodes(toks, return_local_error=True)[1])
    np.testing.assert_allclose(float(error), want, rtol=1e-3)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
  with pytest.raises(ValueError, match="needs local_error_step"):
    model(toks, return_local_error=True)


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("kind", ["diffeqformer", "shared"])
@pytest.mark.parametrize("grid", [None, "smooth"])
def test_step_and_boundary_weights_are_the_weights_generated_apart(kind, grid):
  """The local error's boundary weights (at t = 1 and 0.3), generated in one GEMM with the
  K·S stage times (P read once), equal the stack's weights at each time alone, and the
  stage weights equal step_weights' (midpoint: S = 2), on the uniform grid and a
  non-uniform one; a shared layer's are its one layer."""
  cfg = dataclasses.replace(TINY, kind=kind, solver="midpoint", solver_steps=5)
  model = create_model(cfg, seed=0)
  if kind == "diffeqformer":
    _perturb_hypernet(model, scale=3.0)  # W(t) that changes with t
  g = None if grid is None else jnp.asarray(_smooth_grid(5), jnp.float32)
  weights, dt, method, [boundary, other] = model.step_and_boundary_weights(5, g, [1.0, 0.3])
  want, want_dt, want_method = model.step_weights(5, g)
  alone = model.stack.step_weights(jnp.ones((1, 1), jnp.float32), jnp.float32)
  other_alone = model.stack.step_weights(jnp.full((1, 1), 0.3, jnp.float32), jnp.float32)
  assert method == want_method == "midpoint" and sorted(weights) == sorted(want)
  np.testing.assert_array_equal(np.asarray(dt), np.asarray(want_dt))
  for name in want:
    assert weights[name].shape == want[name].shape and boundary[name].shape[:2] == (1, 1)
    # float32 sums of d_t products in another GEMM shape: rounding on the weights' scale
    scale = 1e-6 * float(np.abs(np.asarray(want[name])).max())
    np.testing.assert_allclose(weights[name], want[name], rtol=1e-6, atol=scale)
    np.testing.assert_allclose(boundary[name], alone[name], rtol=1e-6, atol=scale)
    np.testing.assert_allclose(other[name], other_alone[name], rtol=1e-6, atol=scale)
  if kind == "diffeqformer":  # the boundary is not a stage's: t = 1 is never evaluated
    assert not np.allclose(boundary["wq"][0, 0], weights["wq"][-1, -1])


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("step_time", ["start", "end"])
@pytest.mark.parametrize("stride", [2, 4])
def test_local_error_stride_is_the_error_of_every_nth_row(step_time, stride):
  """model.local_error_stride s: the local error of a packed batch (documents, their
  positions restarting) is the stride-1 error of its rows 0, s, 2s, … alone, and the
  logits are unchanged: only the penalty's rows are subsampled."""
  base = dataclasses.replace(TINY, solver_steps=3, num_layers=3, step_time=step_time)
  model = create_model(base, seed=0)
  _perturb_hypernet(model, scale=3.0)
  rng = np.random.default_rng(5)
  b, length = 8, 8
  toks = jnp.asarray(rng.integers(0, base.vocab_size, (b, length)), jnp.int32)
  cuts = rng.integers(1, length, b)
  seg = jnp.asarray((np.arange(length)[None] >= cuts[:, None]).astype(np.int32))
  pos = jnp.asarray(
    np.where(np.asarray(seg) == 0, np.arange(length), np.arange(length) - cuts[:, None])
  )
  logits, error = model(toks, segment_ids_bl=seg, positions_bl=pos, return_local_error=True)
  strided = nnx.merge(*nnx.split(model))
  strided.config = dataclasses.replace(base, local_error_stride=stride)
  logits_s, error_s = strided(toks, segment_ids_bl=seg, positions_bl=pos, return_local_error=True)
  picked = slice(0, b, stride)
  _, want = model(
    toks[picked], segment_ids_bl=seg[picked], positions_bl=pos[picked], return_local_error=True
  )
  np.testing.assert_array_equal(np.asarray(logits_s), np.asarray(logits))
  np.testing.assert_allclose(float(error_s), float(want), rtol=1e-5)
  assert abs(float(error_s) - float(error)) > 1e-3 * float(error)  # not all rows' error
  # A stride that does not divide the rows: gcd(s, rows) apart (8 rows, s = 6: every 2nd).
  strided.config = dataclasses.replace(base, local_error_stride=6)
  _, error_6 = strided(toks, segment_ids_bl=seg, positions_bl=pos, return_local_error=True)
  _, want_2 = model(
    toks[::2], segment_ids_bl=seg[::2], positions_bl=pos[::2], return_local_error=True
  )
  np.testing.assert_allclose(float(error_6), float(want_2), rtol=1e-5)


def _local_error(model, batch, rng):
  return model(jnp.asarray(batch["inputs"]), return_local_error=True)[1]


def _halves_error(model, batch, rng):
  """The 'halves' error at the step j the train step draws (its documented stream)."""
  key = jax.random.fold_in(rng, steps._HALVES_STREAM)
  j = jax.random.randint(key, (), 0, model.config.depth, jnp.int32)
  return model(jnp.asarray(batch["inputs"]), return_local_error=True, local_error_step=j)[1]


def _interp_error(model, batch, rng):
  """The codes' off-line error at the points the train step draws (the uniform grid)."""
  k = model.config.depth
  alpha = jax.random.uniform(jax.random.fold_in(rng, steps._INTERP_STREAM), (k,))
  return model.stack.interpolation_error(time_grid.uniform_grid(k), alpha)


def _batch(cfg, seed=2):
  rng = np.random.default_rng(seed)
  return {
    "inputs": rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32),
    "targets": rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32),
    "weights": np.ones((2, 8), np.float32),
  }


def _sgd_step(model_cfg, batch, key):
  """(params before, params after, reported loss) of one train step under SGD (lr 1) from
  the init of seed 0 perturbed (so that the field moves x: a non-zero local error)."""
  c = tiny_config("/unused")
  mesh = sharding_lib.make_mesh(c.mesh)
  rules = sharding_lib.logical_axis_rules(c.mesh.rules)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts, state = steps.init_train_state(model_cfg, optax.sgd(1.0), 0, mesh)
    model, optimizer = ts.merge(state)
    _perturb_hypernet(model, scale=3.0)
    state = nnx.state({"model": model, "optimizer": optimizer})
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(state["model"]))
    new_state, m = steps.make_train_step(ts, lambda s: 1.0, rules)(state, batch, key)
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(new_state["model"]))
  return before, after, float(m.loss.compute())


@pytest.mark.parametrize(
  "field,error,form",
  [
    ("local_error_weight", _local_error, "steps"),
    ("local_error_weight", _halves_error, "halves"),
    ("local_error_weight", _halves_error, "both"),
    ("time_interp_weight", _interp_error, "steps"),
  ],
)
def test_the_train_loss_adds_the_weighted_penalty(field, error, form):
  """model.local_error_weight λ (model.time_interp_weight μ): one SGD step (lr 1) moves
  the parameters by the gradient of CE + λ·error, i.e. the λ = 1 step minus the λ = 0 step
  is −∂error/∂θ; the reported loss is the cross-entropy alone. Under
  local_error_form='halves' the error is that of the step the train step draws."""
  cfg = dataclasses.replace(TINY, solver_steps=3, num_layers=3, local_error_form=form)
  batch, key = _batch(cfg), jax.random.key(0)
  after, losses = {}, {}
  for weight in (0.0, 1.0):
    before, after[weight], losses[weight] = _sgd_step(
      dataclasses.replace(cfg, **{field: weight}), batch, key
    )
  # The gradient of the error alone, on a model built outside the mesh with the same params.
  reference = nnx.eval_shape(lambda: create_model(cfg, seed=0))
  graphdef, params = nnx.split(reference)
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, before))
  error_of = lambda p: error(nnx.merge(graphdef, p), batch, key)  # noqa: E731
  error_grad = nnx.to_pure_dict(jax.jit(jax.grad(error_of))(params))
  assert losses[0.0] == losses[1.0]
  moved = jax.tree.map(lambda a, b: a - b, after[1.0], after[0.0])
  flat_moved, flat_grad = jax.tree.leaves(moved), jax.tree.leaves(error_grad)
  assert max(float(np.abs(g).max()) for g in flat_grad) > 1e-6
  for d, g in zip(flat_moved, flat_grad):
    np.testing.assert_allclose(d, -np.asarray(g), atol=1e-5 + 1e-3 * float(np.abs(g).max()))


@pytest.mark.parametrize(
  "kind,field",
  [
    ("transformer", "local_error_weight"),
    ("transformer", "time_interp_weight"),
    ("shared", "time_interp_weight"),
  ],
)
def test_a_kind_without_the_penalty_ignores_its_weight(kind, field):
  """A kind with no solve (λ) or no W(t) (μ) trains exactly as with the weight 0, so
  that a config with the penalty on switches to its baseline by --config.model.kind alone."""
  depth = {"solver_steps": None, "num_layers": 2} if kind == "transformer" else {"solver_steps": 2}
  cfg = dataclasses.replace(TINY, kind=kind, **depth)
  batch, key = _batch(cfg), jax.random.key(0)
  _, off, loss_off = _sgd_step(cfg, batch, key)
  _, on, loss_on = _sgd_step(dataclasses.replace(cfg, **{field: 1000.0}), batch, key)
  assert loss_on == loss_off
  jax.tree.map(np.testing.assert_array_equal, on, off)


@pytest.mark.parametrize("shared", [False, True])
def test_interpolation_error_closed_form(shared, monkeypatch):
  """Codes h(t) = c + t·b (a line) score 0; h(t) = t²·c scores mean_k α_k²(1−α_k)²·dt_k⁴
  / mean_k dt_k²(g_k + g_(k+1))² per group (W's off-line part is −α(1−α)·dt²·P·c, its
  change per step dt·(g_k + g_(k+1))·P·c: P and c cancel); each equals the sum computed
  directly from the generated weights W(t) = P·h(t) + P0, as does a code of two
  directions, whose score depends on P."""
  from odetransformer.model import hypernet

  cfg = dataclasses.replace(TINY, shared_time_mlp=shared)
  model = create_model(cfg, seed=0)
  _perturb_hypernet(model)  # every generator's P non-zero (norms and biases start at 0)
  stack = model.stack
  grid = np.asarray(_smooth_grid(5), np.float32)
  alpha = np.asarray([0.1, 0.5, 0.9, 0.3, 0.7], np.float32)
  u = grid[:-1] + alpha * np.diff(grid)
  c = np.linspace(-1.0, 2.0, cfg.time_embed_dim).astype(np.float32)
  quadratic = np.mean((alpha * (1 - alpha)) ** 2 * np.diff(grid) ** 4) / np.mean(
    (np.diff(grid) * (grid[1:] + grid[:-1])) ** 2
  )
  c2 = np.cos(np.arange(cfg.time_embed_dim)).astype(np.float32)
  for h, want in (
    (lambda t: 0.5 + t[..., None] * c, 0.0),
    (lambda t: 3.0 * t[..., None] ** 2 * c, len(stack.groups) * quadratic),
    # Two directions: how much of W's change is off-line depends on P (the direct sum).
    (lambda t: 3.0 * t[..., None] ** 2 * c + 4.0 * t[..., None] * c2, None),
  ):
    monkeypatch.setattr(hypernet.TimeMLP, "__call__", lambda self, t, h=h: h(t))
    got = float(stack.interpolation_error(jnp.asarray(grid), jnp.asarray(alpha)))
    if want is not None:
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)
    # Directly on the generated weights, per group.
    ends = stack.step_weights(jnp.asarray(grid), jnp.float32)
    mid = stack.step_weights(jnp.asarray(u), jnp.float32)
    off, change = {}, {}
    for name, spec in stack.specs.items():
      e, m = (np.asarray(x[name], np.float64).reshape(len(x[name]), -1) for x in (ends, mid))
      line = (1 - alpha[:, None]) * e[:-1] + alpha[:, None] * e[1:]
      off[spec.group] = off.get(spec.group, 0.0) + np.sum((m - line) ** 2, -1)
      change[spec.group] = change.get(spec.group, 0.0) + np.sum((e[1:] - e[:-1]) ** 2, -1)
    direct = sum(np.mean(off[g]) / np.mean(change[g]) for g in stack.groups)
    np.testing.assert_allclose(got, direct, rtol=1e-4, atol=1e-9)


@pytest.mark.slow
def test_train_step_solves_on_the_grid_drawn_from_its_rng():
  """The train step's loss is the model's loss on random_offset_grid(fold_in(rng,
  _GRID_STREAM), K), not on the uniform grid (both taken directly from the same params)."""
  c = tiny_config("/unused")
  c.model.train_time_grid = "random_offset"
  c.model.solver_steps = c.model.num_layers = 3
  cfg = config_lib.model_config(c, 64)
  mesh = sharding_lib.make_mesh(c.mesh)
  rules = sharding_lib.logical_axis_rules(c.mesh.rules)
  rng = np.random.default_rng(2)
  batch = {
    "inputs": rng.integers(0, 64, (2, 16)).astype(np.int32),
    "targets": rng.integers(0, 64, (2, 16)).astype(np.int32),
    "weights": np.ones((2, 16), np.float32),
  }
  key = jax.random.key(7)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts, state = steps.init_train_state(cfg, optax.sgd(0.0), 0, mesh)
    model, optimizer = ts.merge(state)
    _perturb_hypernet(model, scale=3.0)  # a field that moves x, so grids differ in loss
    state = nnx.state({"model": model, "optimizer": optimizer})
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state["model"]))
    step = steps.make_train_step(ts, lambda s: 0.0, rules)
    _, m = step(state, batch, key)
  # Its structure only (no initial values: no op-by-op init): every array is set to the
  # train state's params.
  reference = nnx.eval_shape(lambda: create_model(cfg, seed=0))
  graphdef, ref_state = nnx.split(reference)
  nnx.replace_by_pure_dict(ref_state, jax.tree.map(jnp.asarray, params))
  reference = nnx.merge(graphdef, ref_state)

  @nnx.jit  # one compiled forward for both grids, not op-by-op dispatch
  def grid_loss(model, grid):
    logits = model(jnp.asarray(batch["inputs"]), time_grid=grid)
    s, w = token_cross_entropy(logits.astype(jnp.float32), jnp.asarray(batch["targets"]))
    return s / w

  loss = lambda grid: float(grid_loss(reference, grid))

  drawn = time_grid.random_offset_grid(jax.random.fold_in(key, steps._GRID_STREAM), 3)
  on_grid, uniform = loss(drawn), loss(time_grid.uniform_grid(3))
  got = float(m.loss.compute())
  assert abs(got - on_grid) <= 1e-5 * on_grid
  assert abs(uniform - on_grid) > 100 * abs(got - on_grid) + 1e-4, (uniform, on_grid, got)


def test_new_model_fields_match_fingerprints_written_before_them():
  """A checkpoint written before model.step_time / model.llama_block existed resumes
  under their defaults (its meaning then); a stored value that differs does not, nor a
  new config that sets the added field to another value than its default."""
  c = tiny_config("/unused")
  new = fingerprint(c)
  assert new["model"]["step_time"] == "start" and new["model"]["llama_block"] == "paper"
  old = {
    **new,
    "model": {k: v for k, v in new["model"].items() if k not in ("step_time", "llama_block")},
  }
  assert fingerprint_diffs(old, new) == []
  c.model.step_time = "end"
  assert fingerprint_diffs(new, fingerprint(c)) == ["model.step_time 'start' -> 'end'"]
  # Nor does a config that sets the added field otherwise: the old run meant its default.
  assert fingerprint_diffs(old, fingerprint(c)) == ["model.step_time 'start' -> 'end'"]
  c.model.step_time = "start"
  # A run from before the local error penalty (no field of it stored) meant λ = 0: under
  # configs/default.py's penalty it does not resume, and the refusal names each field.
  penalty = ("local_error_weight", "local_error_stride", "local_error_form")
  assert tuple(c.model[k] for k in penalty) == (3000.0, 4, "both")
  before_penalty = {**new, "model": {k: v for k, v in new["model"].items() if k not in penalty}}
  assert fingerprint_diffs(before_penalty, fingerprint(c)) == [
    "model.local_error_form 'steps' -> 'both'",
    "model.local_error_stride 1 -> 4",
    "model.local_error_weight 0.0 -> 3000.0",
  ]
  # A run of the node terms alone (stored before local_error_form existed) meant 'steps'.
  c.model.local_error_form = "steps"
  steps_run = {**new, "model": {k: v for k, v in new["model"].items() if k != "local_error_form"}}
  assert fingerprint_diffs(steps_run, fingerprint(c)) == []
  c.model.local_error_form = "both"
  assert fingerprint_diffs(steps_run, fingerprint(c)) == [
    "model.local_error_form 'steps' -> 'both'"
  ]
  # With λ = 0 again it resumes, whatever the stride and form (which only λ reads) ...
  c.model.local_error_weight = 0.0
  assert fingerprint_diffs(before_penalty, fingerprint(c)) == []
  # ... and so does a discrete model under the penalty, which it ignores, but not an ODE.
  c.model.local_error_weight = 3000.0
  c.model.kind = "transformer"
  old_gpt = {**before_penalty, "model": {**before_penalty["model"], "kind": "transformer"}}
  assert fingerprint_diffs(old_gpt, fingerprint(c)) == []
  c.model.kind = "diffeqformer"
  # The depth a kind does not read (an ODE's num_layers) is not compared, set or not.
  c.model.num_layers = 7
  assert fingerprint_diffs(old, fingerprint(c)) == []


def test_local_error_weight_is_checked():
  with pytest.raises(ValueError, match=r"local_error_weight=-1.0 must be >= 0"):
    dataclasses.replace(TINY, local_error_weight=-1.0)
  with pytest.raises(ValueError, match=r"time_interp_weight=-1.0 must be >= 0"):
    dataclasses.replace(TINY, time_interp_weight=-1.0)
