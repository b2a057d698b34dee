"""Fixed-step ODE solvers as one `jax.lax.scan` with rematerialisation.

A solver is a pure function of a vector field, an initial state and the field's
time-dependent inputs on the solver's stage grid. The field is `field(x, inputs)`,
where `inputs` is whatever the field needs at one time (for DiffEqFormer: the layer
weights W(t) generated beforehand; for a test: the scalar t). Stage times of step k are
`t_k + c_s·dt` with the method's nodes `c` (see `STAGE_NODES`), so a caller evaluates
its time-dependent inputs at `stage_times(K, method)` — for the hypernetwork that is
one batched GEMM — and the scan slices them per step. Nothing is unrolled: program size
and compile time do not grow with K.

A non-uniform grid 0 = g_0 < g_1 < … < g_K = 1 (`grid_stage_times`) has a step size
per step, dt_k = g_{k+1} - g_k; the solver then scans the step sizes beside the inputs.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

# Nodes c_s (fractions of dt) at which each method evaluates the field.
STAGE_NODES = {
    "euler": (0.0,),
    "midpoint": (0.0, 0.5),
    "rk4": (0.0, 0.5, 1.0),  # k2 and k3 share the midpoint node
}


class Tableau(NamedTuple):
  """An explicit Runge–Kutta method: field evaluation e runs at node
  STAGE_NODES[method][stages[e]] on x + dt·Σ_j a[e][j]·k_j, and the step is
  x + dt·Σ_e b[e]·k_e."""
  stages: tuple
  a: tuple
  b: tuple


TABLEAUX = {
    "euler": Tableau(stages=(0,), a=((),), b=(1.0,)),
    "midpoint": Tableau(stages=(0, 1), a=((), (0.5,)), b=(0.0, 1.0)),
    "rk4": Tableau(stages=(0, 1, 1, 2), a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
                   b=(1 / 6, 1 / 3, 1 / 3, 1 / 6)),
}


def rk_step(field: Callable[[Any, int], Any], method: str, x, dt):
  """One step x_k -> x_{k+1} of `method`; `field(x_in, e)` is its e-th field evaluation
  (at stage TABLEAUX[method].stages[e]). Used by the solver and by cached decoding."""
  tableau = TABLEAUX[method]
  ks = []
  for e, row in enumerate(tableau.a):
    x_in = x
    for a_ej, k in zip(row, ks):
      if a_ej:
        x_in = x_in + (a_ej * dt) * k
    ks.append(field(x_in, e))
  update = None
  for b_e, k in zip(tableau.b, ks):
    if b_e:
      update = b_e * k if update is None else update + b_e * k
  return x + dt * update


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def stage_times(num_steps: int, method: str, t0: float = 0.0, t1: float = 1.0):
  """[K, S] times t_k + c_s·dt for a uniform grid on [t0, t1]."""
  dt = (t1 - t0) / num_steps
  tk = t0 + dt * jnp.arange(num_steps, dtype=jnp.float32)
  nodes = jnp.asarray(STAGE_NODES[method], jnp.float32)
  return tk[:, None] + dt * nodes[None, :]


def grid_stage_times(grid, method: str):
  """Stage times [K, S] (g_k + c_s·dt_k) and step sizes [K] (dt_k = g_{k+1} - g_k) of a
  time grid [K+1]."""
  grid = jnp.asarray(grid, jnp.float32)
  tk, dts = grid[:-1], jnp.diff(grid)
  nodes = jnp.asarray(STAGE_NODES[method], jnp.float32)
  return tk[:, None] + dts[:, None] * nodes[None, :], dts


def _step(field, method):
  """One step (x_k, (inputs, eval_inputs), dt) -> x_{k+1}; `inputs` has a leading stage
  axis of size S, `eval_inputs` (None, or leaves [E, ...]) one of field evaluations."""
  stages = TABLEAUX[method].stages

  def step(x, inp, dt):
    inp, ev = inp

    def f(x_in, e):
      at = jax.tree.map(lambda a: a[stages[e]], inp)
      if ev is None:
        return field(x_in, at)
      return field(x_in, at, jax.tree.map(lambda a: a[e], ev))
    return rk_step(f, method, x, dt)
  return step


def fixed_step_solve(field: Callable[[Any, Any], Any], x0, stage_inputs, dt,
                     method: str = "euler", remat_policy: str = "none",
                     return_trajectory: bool = False, eval_inputs=None):
  """Integrates dx/dt = field(x, inputs(t)) with K fixed steps.

  Args:
    field: vector field `field(x, inputs_at_one_time) -> dx/dt` (same shape as x).
    x0: initial state (an array).
    stage_inputs: pytree whose leaves are [K, S, ...]: the field's inputs at
      `stage_times(K, method)` (or `grid_stage_times(grid, method)`); K is read from the
      leading axis.
    dt: step size: a python float (uniform steps), or a [K] array of per-step sizes
      (a non-uniform grid; scanned with the inputs and cast to x0's dtype, so a
      bfloat16 state stays bfloat16 as it does with a python float).
    method: 'euler' | 'midpoint' | 'rk4'.
    remat_policy: key of `REMAT_POLICIES`; anything but 'none' rematerialises each
      step in the backward pass, keeping only the carry (and saved dots).
    return_trajectory: also return the states before each step, [K, ...].
    eval_inputs: optional pytree whose leaves are [K, E, ...], one entry per field
      evaluation of a step (E = len(TABLEAUX[method].stages); rk4's 2nd and 3rd
      evaluations share a stage, not these), e.g. dropout keys; when given, the field
      is called as `field(x, inputs_at_one_time, eval_inputs_at_one_evaluation)`.
  Returns:
    x_K, or (x_K, [x_0 … x_{K-1}]) with return_trajectory.
  """
  if method not in STAGE_NODES:
    raise ValueError(f"unknown solver {method!r}; choose one of {sorted(STAGE_NODES)}")
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f"unknown remat_policy {remat_policy!r}; "
                     f"choose one of {sorted(REMAT_POLICIES)}")
  step = _step(field, method)
  per_step = not isinstance(dt, (int, float))
  if per_step:
    dt = jnp.asarray(dt).astype(x0.dtype)
    num_steps = jax.tree.leaves(stage_inputs)[0].shape[0]
    if dt.shape != (num_steps,):
      raise ValueError(f"dt has shape {dt.shape}; expected a float or ({num_steps},), "
                       "one step size per step")
    xs = ((stage_inputs, eval_inputs), dt)
  else:
    # A uniform dt stays a constant of the program (closed over, not traced).
    step = functools.partial(step, dt=dt)
    xs = (stage_inputs, eval_inputs)
  if remat_policy != "none":
    step = jax.checkpoint(step, policy=REMAT_POLICIES[remat_policy])

  def body(x, xs_k):
    x_next = step(x, *xs_k) if per_step else step(x, xs_k)
    return x_next, (x if return_trajectory else None)

  x, traj = jax.lax.scan(body, x0, xs)
  return (x, traj) if return_trajectory else x
