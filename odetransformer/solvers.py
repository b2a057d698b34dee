"""Fixed-step ODE solvers as one `jax.lax.scan` with rematerialisation.

A solver is a pure function of a vector field, an initial state and the field's
time-dependent inputs on the solver's stage grid. The field is `field(x, inputs)`,
where `inputs` is whatever the field needs at one time (for DiffEqFormer: the layer
weights W(t) generated beforehand; for a test: the scalar t). Stage times of step k are
`t_k + c_s·dt` with the method's nodes `c` (see `STAGE_NODES`), so a caller evaluates
its time-dependent inputs at `stage_times(K, method)` — for the hypernetwork that is
one batched GEMM — and the scan slices them per step. Nothing is unrolled: program size
and compile time do not grow with K.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Nodes c_s (fractions of dt) at which each method evaluates the field.
STAGE_NODES = {
    "euler": (0.0,),
    "midpoint": (0.0, 0.5),
    "rk4": (0.0, 0.5, 1.0),  # k2 and k3 share the midpoint node
}

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


def _step(field, method, dt):
  """One step x_k -> x_{k+1}; `inp` has a leading stage axis of size S."""
  def at(inp, s):
    return jax.tree.map(lambda a: a[s], inp)

  def euler(x, inp):
    return x + dt * field(x, at(inp, 0))

  def midpoint(x, inp):
    k1 = field(x, at(inp, 0))
    return x + dt * field(x + (0.5 * dt) * k1, at(inp, 1))

  def rk4(x, inp):
    k1 = field(x, at(inp, 0))
    k2 = field(x + (0.5 * dt) * k1, at(inp, 1))
    k3 = field(x + (0.5 * dt) * k2, at(inp, 1))
    k4 = field(x + dt * k3, at(inp, 2))
    return x + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)

  return {"euler": euler, "midpoint": midpoint, "rk4": rk4}[method]


def fixed_step_solve(field: Callable[[Any, Any], Any], x0, stage_inputs, dt,
                     method: str = "euler", remat_policy: str = "none",
                     return_trajectory: bool = False):
  """Integrates dx/dt = field(x, inputs(t)) with K fixed steps.

  Args:
    field: vector field `field(x, inputs_at_one_time) -> dx/dt` (same shape as x).
    x0: initial state (array or pytree of arrays matching field's output).
    stage_inputs: pytree whose leaves are [K, S, ...]: the field's inputs at
      `stage_times(K, method)`; K is read from the leading axis.
    dt: step size (python float or scalar array).
    method: 'euler' | 'midpoint' | 'rk4'.
    remat_policy: key of `REMAT_POLICIES`; anything but 'none' rematerialises each
      step in the backward pass, keeping only the carry (and saved dots).
    return_trajectory: also return the states before each step, [K, ...].
  Returns:
    x_K, or (x_K, [x_0 … x_{K-1}]) with return_trajectory.
  """
  if method not in STAGE_NODES:
    raise ValueError(f"unknown solver {method!r}; choose one of {sorted(STAGE_NODES)}")
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f"unknown remat_policy {remat_policy!r}; "
                     f"choose one of {sorted(REMAT_POLICIES)}")
  step = _step(field, method, dt)
  if remat_policy != "none":
    step = jax.checkpoint(step, policy=REMAT_POLICIES[remat_policy])

  def body(x, inp):
    x_next = step(x, inp)
    return x_next, (x if return_trajectory else None)

  x, traj = jax.lax.scan(body, x0, stage_inputs)
  return (x, traj) if return_trajectory else x
