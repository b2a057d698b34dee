"""Time grids of the ODE solve: the uniform one, and the random ones drawn in training.

A grid is [K+1] increasing times 0 = g_0 < g_1 < … < g_K = 1; step k goes from g_k to
g_{k+1}. Evaluation, materialisation and generation use the uniform grid g_k = k/K.

Trained on the uniform grid alone, a DiffEqFormer learns a K-step map at the times k/K,
not a vector field: W(t) between those times is never trained, and a finer solve walks
away from the trained one (the trap of Ott et al., "ResNet After All?", ICLR 2021).
`model.train_time_grid` names how the train step draws a grid per batch instead. What
a grid trains is the set of times the solver evaluates on it (`solvers.stage_times`,
`model.step_time`): Euler evaluates step k at g_k ('start') or g_{k+1} ('end').

- 'fixed': the uniform grid.
- 'random_shift': the interior times are shifted by one offset dt0 ~ U(0, 2·dt) per
  batch, g = [0, dt0, dt0 + dt, …, dt0 + (K-2)·dt, 1] with dt = 1/K: interior steps are
  dt, the first dt0 and the last 2·dt - dt0, both in (0, 2·dt). The step starts
  g_0 … g_{K-1} then cover [0, 1) and the step ends g_1 … g_K cover (0, 1], so every
  solver under either step time evaluates every t in [0, 1] that a solve at another N
  may (tests/test_time_grid.py). The draw is symmetric under t -> 1 - t. Same K, so the
  same cost per step.
- 'random_offset': the authors' scheme (SDML-KU/qkvflow `generate_t`, left switched off
  there), the same grid with dt0 ~ U(0, dt). Its evaluation points never reach
  [(K-1)/K, 1) under either step time (Euler under 'end' evaluates the last step only at
  1): for K = 4, N = 8 evaluates t = 7/8, which no batch trained. Kept to reproduce the
  reference; prefer 'random_shift'.
- 'random_uniform': the K-1 interior times are sorted draws of U(0, 1) per batch (the
  reference code's other, commented-out scheme): step sizes from ~0 to several dt, so
  the K-step solve is trained at many step sizes, not only at dt, and the step starts
  (ends) cover [0, 1) ((0, 1]). Same cost per step.

`model.train_time_grid_fraction` < 1 mixes: a batch draws the option's random grid
with that probability and trains on the uniform grid otherwise.
"""

import jax
import jax.numpy as jnp

TRAIN_TIME_GRIDS = ("fixed", "random_shift", "random_offset", "random_uniform")


def uniform_grid(num_steps: int):
  """[K+1] times k/K."""
  return jnp.arange(num_steps + 1, dtype=jnp.float32) / num_steps


def random_offset_grid(key, num_steps: int, max_offset: float = 1.0):
  """[K+1] grid [0, dt0, dt0 + dt, …, dt0 + (K-2)·dt, 1], dt0 ~ U(0, max_offset/K)
  (1: the reference's 'random_offset'; 2: 'random_shift')."""
  dt = 1.0 / num_steps
  dt0 = jax.random.uniform(key, (), jnp.float32, 0.0, max_offset * dt)
  interior = dt0 + dt * jnp.arange(num_steps - 1, dtype=jnp.float32)
  return jnp.concatenate([jnp.zeros((1,), jnp.float32), interior, jnp.ones((1,), jnp.float32)])


def random_uniform_grid(key, num_steps: int):
  """[K+1] grid [0, sorted K-1 draws of U(0, 1), 1]."""
  interior = jnp.sort(jax.random.uniform(key, (num_steps - 1,), jnp.float32))
  return jnp.concatenate([jnp.zeros((1,), jnp.float32), interior, jnp.ones((1,), jnp.float32)])


def train_time_grid(cfg, key) -> jax.Array | None:
  """The grid of one training batch for `cfg.train_time_grid`; None = the uniform grid
  of `cfg.depth` (also for discrete kinds, whose depth has no time). With
  `cfg.train_time_grid_fraction` < 1 a batch draws the random grid with that
  probability and otherwise gets the uniform grid (same K, same program)."""
  if not cfg.is_ode or cfg.train_time_grid == "fixed":
    return None
  grid_key, coin = jax.random.split(key) if cfg.train_time_grid_fraction < 1.0 else (key, None)
  if cfg.train_time_grid in ("random_offset", "random_shift"):
    max_offset = 2.0 if cfg.train_time_grid == "random_shift" else 1.0
    grid = random_offset_grid(grid_key, cfg.depth, max_offset)
  elif cfg.train_time_grid == "random_uniform":
    grid = random_uniform_grid(grid_key, cfg.depth)
  else:
    raise ValueError(
      f"model.train_time_grid={cfg.train_time_grid!r} is unknown; "
      f"choose one of {list(TRAIN_TIME_GRIDS)}"
    )
  if coin is None:
    return grid
  random = jax.random.uniform(coin) < cfg.train_time_grid_fraction
  return jnp.where(random, grid, uniform_grid(cfg.depth))


def check_time_grid(grid) -> int:
  """K of a [K+1] grid; a concrete grid must also run from 0 to 1, increasing."""
  shape = jnp.shape(grid)
  if len(shape) != 1 or shape[0] < 2:
    raise ValueError(f"time_grid has shape {shape}; expected [K+1] times with K >= 1")
  if not isinstance(grid, jax.core.Tracer):
    g = jax.device_get(grid)
    if not (g[0] == 0.0 and g[-1] == 1.0 and (g[1:] > g[:-1]).all()):
      raise ValueError(
        f"time_grid {list(map(float, g))} must increase from 0 to 1; "
        "pass [K+1] times 0 = g_0 < … < g_K = 1"
      )
  return shape[0] - 1
