"""Fixed-step ODE solvers as one `jax.lax.scan` with rematerialisation.

A solver is a pure function of a vector field, an initial state and the field's
time-dependent inputs on the solver's stage grid. The field is `field(x, inputs)`,
where `inputs` is whatever the field needs at one time (for DiffEqFormer: the layer
weights W(t) generated beforehand; for a test: the scalar t). Stage times of step k are
`t_k + c_s·dt` with the method's nodes `c` (see `STAGE_NODES`), so a caller evaluates
its time-dependent inputs at `stage_times(K, method, step_time)` — for the hypernetwork
that is one batched GEMM — and the scan slices them per step. Nothing is unrolled:
program size and compile time do not grow with K.

Two conventions place the nodes within a step (`model.step_time`, `stage_nodes`):

- 'start' (ours, the textbook tableaux): Euler evaluates step k at its start t_k.
- 'end' (the authors' code, SDML-KU/qkvflow: step k's layer is at t = (k+1)·dt): the
  nodes reflected within the step, c -> 1 - c, where that keeps the method's order:
  Euler (1,), the reference's scheme; midpoint (1, ½), its first (predictor) evaluation
  at the step's end and its update still at the midpoint (second order). RK4's node
  set {0, ½, 1} is its own reflection, and reflecting the stages' order would cost its
  fourth order, so RK4 keeps its nodes: it is the same scheme under both conventions.

A non-uniform grid 0 = g_0 < g_1 < … < g_K = 1 (`grid_stage_times`) has a step size
per step, dt_k = g_{k+1} - g_k; the solver then scans the step sizes beside the inputs.
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

# Nodes c_s (fractions of dt) at which each method evaluates the field: the textbook
# tableaux, step_time='start'.
STAGE_NODES = {
    "euler": (0.0,),
    "midpoint": (0.0, 0.5),
    "rk4": (0.0, 0.5, 1.0),  # k2 and k3 share the midpoint node
}
# step_time='end' (module docstring): the same stages, nodes reflected where that keeps
# the method's order.
END_STAGE_NODES = {
    "euler": (1.0,),
    "midpoint": (1.0, 0.5),
    "rk4": (0.0, 0.5, 1.0),
}
STEP_TIMES = ("start", "end")


def stage_nodes(method: str, step_time: str = "start") -> tuple:
  """Nodes c_s of `method` under the step-time convention `step_time`."""
  if step_time not in STEP_TIMES:
    raise ValueError(f"unknown step_time {step_time!r}; choose one of {list(STEP_TIMES)}")
  return (STAGE_NODES if step_time == "start" else END_STAGE_NODES)[method]


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


def stage_times(num_steps: int, method: str, step_time: str = "start"):
  """[K, S] times (k + c_s)·dt of the uniform grid on [0, 1], dt = 1/K (float32;
  Euler under 'end': (k+1)·dt, as the reference computes them)."""
  dt = jnp.float32(1.0 / num_steps)
  nodes = jnp.asarray(stage_nodes(method, step_time), jnp.float32)
  return (jnp.arange(num_steps, dtype=jnp.float32)[:, None] + nodes[None, :]) * dt


def grid_stage_times(grid, method: str, step_time: str = "start"):
  """Stage times [K, S] (g_k + c_s·dt_k) and step sizes [K] (dt_k = g_{k+1} - g_k) of a
  time grid [K+1]; a node at 1 is g_{k+1} itself."""
  grid = jnp.asarray(grid, jnp.float32)
  tk, dts = grid[:-1], jnp.diff(grid)
  nodes = stage_nodes(method, step_time)
  ts = [grid[1:] if c == 1.0 else tk + c * dts for c in nodes]
  return jnp.stack(ts, axis=1), dts


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
