"""Fixed-step ODE solvers as one `jax.lax.scan` with rematerialisation.

A solver is a pure function of a vector field, an initial state and the field's
time-dependent inputs on the solver's stage grid. The field is `field(x, inputs)`,
where `inputs` is whatever the field needs at one time (for DiffEqFormer: the layer
weights W(t) generated beforehand; for a test: the scalar t). Stage times of step k are
`t_k + c_s·dt` with the method's nodes `c` (see `STAGE_NODES`), so a caller evaluates
its time-dependent inputs at `stage_times(K, method, step_time)` — for the hypernetwork
that is one batched GEMM — and the scan slices them per step. By default nothing is
unrolled: program size and compile time do not grow with K (`model.layer_loop` unrolls it
where that serves, `loop_unroll`).

Two conventions place the nodes within a step (`model.step_time`, `stage_nodes`):

- 'start' (ours, the textbook tableaux): Euler evaluates step k at its start t_k.
- 'end' (the authors' code, SDML-KU/qkvflow: step k's layer is at t = (k+1)·dt): the
  nodes reflected within the step, c -> 1 - c, where that keeps the method's order:
  Euler (1,), the reference's scheme; midpoint (1, ½), its first (predictor) evaluation
  at the step's end and its update still at the midpoint (second order). RK4's node
  set {0, ½, 1} is its own reflection, and reflecting the stages' order would cost its
  fourth order, so RK4 keeps its nodes: it is the same scheme under both conventions.

A splitting method integrates a field that is a sum of parts, dx/dt = f_0 + f_1, one
part per field evaluation: 'split_euler' (Lie–Trotter) is an Euler substep of f_0, then
an Euler substep of f_1 from the updated state, both at the step's one node (t_k under
'start', t_{k+1} under 'end', as Euler's): x' = x + dt·f_0(x, t), x_{k+1} = x' +
dt·f_1(x', t). First order, like Euler, and Euler itself when either part is zero. For
DiffEqFormer the parts are the attention update and the MLP update
(`blocks.BLOCK_PARTS`): one split step is one pre-norm GPT-2/Llama block
(`blocks.sequential_block`) with dt on its output projections, so a pre-trained stack of
L such blocks is this solver at N = L. The field is then called with `part=i` and
returns f_i (`Tableau.parts`); the other methods call it without.

A non-uniform grid 0 = g_0 < g_1 < … < g_K = 1 (`grid_stage_times`) has a step size
per step, dt_k = g_{k+1} - g_k; the solver then scans the step sizes beside the inputs.

This module is the one place that walks a method's stages (tableaux, stage times, the
step): the model's forward pass and cached decoding both run `fixed_step_solve`.
"""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Nodes c_s (fractions of dt) at which each method evaluates the field: the textbook
# tableaux, step_time='start'.
STAGE_NODES = {
  "euler": (0.0,),
  "midpoint": (0.0, 0.5),
  "rk4": (0.0, 0.5, 1.0),  # k2 and k3 share the midpoint node
  "split_euler": (0.0,),  # both substeps at the step's start, as Euler
}
# step_time='end' (module docstring): the same stages, nodes reflected where that keeps
# the method's order.
END_STAGE_NODES = {
  "euler": (1.0,),
  "midpoint": (1.0, 0.5),
  "rk4": (0.0, 0.5, 1.0),
  "split_euler": (1.0,),
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
  x + dt·Σ_e b[e]·k_e. `parts` (a splitting method: an additive Runge–Kutta one):
  evaluation e computes only the field's part parts[e] of f = f_0 + f_1 + …; None:
  every evaluation is the whole field."""

  stages: tuple
  a: tuple
  b: tuple
  parts: tuple | None = None


TABLEAUX = {
  "euler": Tableau(stages=(0,), a=((),), b=(1.0,)),
  "midpoint": Tableau(stages=(0, 1), a=((), (0.5,)), b=(0.0, 1.0)),
  "rk4": Tableau(
    stages=(0, 1, 1, 2), a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)), b=(1 / 6, 1 / 3, 1 / 3, 1 / 6)
  ),
  # Lie–Trotter: k_0 = f_0(x), k_1 = f_1(x + dt·k_0), x + dt·(k_0 + k_1).
  "split_euler": Tableau(stages=(0, 0), a=((), (1.0,)), b=(1.0, 1.0), parts=(0, 1)),
}


def rk_step(field: Callable[[Any, int], Any], method: str, x, dt):
  """One step x_k -> x_{k+1} of `method`; `field(x_in, e)` is its e-th field evaluation
  (at stage TABLEAUX[method].stages[e], of part TABLEAUX[method].parts[e] when the
  method splits the field); `fixed_step_solve` scans it."""
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
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# layer_loop='auto' unrolls the loop on GPUs up to this many steps: compile time grows
# with the steps unrolled (benchmarks/README.md), and a solve at many more steps (any-N
# evaluation at 2K or 4K steps) stays a scan.
MAX_AUTO_UNROLL = 48


def loop_unroll(layer_loop: str, num_steps: int, platform: str) -> int:
  """lax.scan's `unroll` for `model.layer_loop` on `platform`: K (every step its own
  code, no loop) or 1 (one scan)."""
  if layer_loop == "unrolled" or (
    layer_loop == "auto" and platform in ("cuda", "rocm") and num_steps <= MAX_AUTO_UNROLL
  ):
    return num_steps
  return 1


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


def num_evals(method: str) -> int:
  """Field evaluations E of one `method` step (rk4: 4, its 2nd and 3rd at one stage;
  split_euler: 2, one per part)."""
  return len(TABLEAUX[method].stages)


def num_parts(method: str) -> int:
  """Parts of the field `method` evaluates apart (1: the whole field every time)."""
  parts = TABLEAUX[method].parts
  return 1 if parts is None else len(set(parts))


def field_cost(method: str) -> float:
  """Whole-field evaluations one `method` step costs (its evaluations, each part of a
  split field a fraction): rk4 4, split_euler 1 (attention once, the MLP once)."""
  return num_evals(method) / num_parts(method)


def solve_times(num_steps: int, method: str, step_time: str = "start", time_grid=None):
  """(stage times [K, S], dt) of a K-step solve: the uniform grid's (dt = 1/K, a python
  float) or, given a `time_grid` [K+1], its own (dt [K], `grid_stage_times`)."""
  if time_grid is not None:
    return grid_stage_times(time_grid, method, step_time)
  return stage_times(num_steps, method, step_time), 1.0 / num_steps


def broadcast_stages(stage_inputs, times):
  """`stage_inputs` with every leaf [K, S, ...]: a leaf [1, 1, ...] (the same at every
  stage, see `fixed_step_solve`) copied to the [K, S] of `times`."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, times.shape + a.shape[2:]), stage_inputs)


def _step(field, method, constants, with_outputs):
  """One step (x_k, (inputs, eval_inputs), dt) -> (x_{k+1}, outputs [E, ...] or None).

  `inputs` is a list of the per-step input leaves (each [S, ...]) and `constants` the
  step-independent ones (the same at every stage); `eval_inputs` (None, or leaves
  [E, ...]) has one entry per field evaluation, and so have the field's `outputs`.
  A splitting method's evaluation e calls the field with `part=parts[e]`."""
  stages, parts = TABLEAUX[method].stages, TABLEAUX[method].parts

  def step(x, inp, dt):
    inp, ev = inp
    outputs = []

    def f(x_in, e):
      at = constants(jax.tree.map(lambda a: a[stages[e]], inp))
      args = (x_in, at) if ev is None else (x_in, at, jax.tree.map(lambda a: a[e], ev))
      out = field(*args) if parts is None else field(*args, part=parts[e])
      if with_outputs:
        out, aux = out
        outputs.append(aux)
      return out

    x = rk_step(f, method, x, dt)
    return x, (jax.tree.map(lambda *a: jnp.stack(a), *outputs) if with_outputs else None)

  return step


def _split_constants(stage_inputs, num_stages: int):
  """(per-step leaves, rebuild): leaves [K, S, ...] are scanned; a leaf of leading shape
  [1, 1] is the same at every step and stage, closed over instead of copied K·S times;
  `rebuild(per-step leaves at one stage)` is the input tree at that stage."""
  leaves, treedef = jax.tree.flatten(stage_inputs)
  constant = []
  for leaf in leaves:
    lead = tuple(jnp.shape(leaf)[:2])
    if lead == (1, 1):
      constant.append(True)
    elif len(lead) == 2 and lead[1] == num_stages:
      constant.append(False)
    else:
      raise ValueError(
        f"a stage input has leading axes {lead}; expected [K, {num_stages}] "
        "(steps, stages) or [1, 1] (the same at every stage)"
      )
  fixed = [leaf[0, 0] for leaf, c in zip(leaves, constant) if c]
  scanned = [leaf for leaf, c in zip(leaves, constant) if not c]

  def rebuild(at):
    it_scanned, it_fixed = iter(at), iter(fixed)
    return jax.tree.unflatten(
      treedef, [next(it_fixed) if c else next(it_scanned) for c in constant]
    )

  return scanned, rebuild


def every_nth_row(s: int):
  """a -> rows 0, s, 2s, … of a's leading axis (the identity for s = 1). Taken as a
  reshape to [rows/s, s, …] and its first column, so that a batch split over devices in
  contiguous blocks of a multiple of s rows keeps its rows where they are."""
  if s == 1:
    return lambda a: a

  def pick(a):
    if a.shape[0] % s:
      raise ValueError(f"{a.shape[0]} rows are not a multiple of the stride {s}")
    return a.reshape(a.shape[0] // s, s, *a.shape[1:])[:, 0]

  return pick


def fixed_step_solve(
  field: Callable[..., Any],
  x0,
  stage_inputs,
  dt,
  method: str = "euler",
  remat_policy: str = "none",
  return_trajectory: bool = False,
  eval_inputs=None,
  num_steps: int | None = None,
  eval_outputs: bool = False,
  unroll: int = 1,
  local_error: bool = False,
  boundary_inputs=None,
  boundary: str = "end",
  error_stride: int = 1,
  error_nodes: bool = True,
  error_step=None,
  halves_inputs=None,
):
  """Integrates dx/dt = field(x, inputs(t)) with K fixed steps.

  Args:
    field: vector field `field(x, inputs_at_one_time) -> dx/dt` (same shape as x);
      for a splitting method (split_euler) `field(x, inputs_at_one_time, part=i)`, the
      i-th part f_i of dx/dt = f_0 + f_1.
    x0: initial state (an array).
    stage_inputs: pytree whose leaves are [K, S, ...]: the field's inputs at
      `stage_times(K, method)` (or `grid_stage_times(grid, method)`); K is read from the
      leading axis. A leaf [1, 1, ...] is the same at every step and stage (broadcast as
      numpy would, without K·S copies: a weight-shared layer).
    dt: step size: a python float (uniform steps), or a [K] array of per-step sizes
      (a non-uniform grid; scanned with the inputs and cast to x0's dtype, so a
      bfloat16 state stays bfloat16 as it does with a python float).
    method: 'euler' | 'midpoint' | 'rk4' | 'split_euler'.
    remat_policy: key of `REMAT_POLICIES`; anything but 'none' rematerialises each
      step in the backward pass, keeping only the carry (and saved dots).
    return_trajectory: also return the states before each step, [K, ...].
    eval_inputs: optional pytree whose leaves are [K, E, ...], one entry per field
      evaluation of a step (E = `num_evals(method)`; rk4's 2nd and 3rd evaluations
      share a stage, not these; split_euler's two parts share it too), e.g. dropout
      keys or KV-cache slots; when given, the field is called as
      `field(x, inputs_at_one_time, eval_inputs_at_one_evaluation)`.
    num_steps: K, needed only when no input has a K axis (every leaf [1, 1, ...] and a
      float dt).
    eval_outputs: the field returns `(dx/dt, output)`; the outputs of every evaluation
      are returned stacked [K, E, ...] (e.g. a KV cache's updated slots).
    unroll: `jax.lax.scan`'s: steps per loop iteration; K unrolls the whole loop
      (`loop_unroll`). The same values either way.
    local_error: also return Σ_k mean(e_k²) (float32), e_k = dt_{k-1}/2·(F_k − F_{k-1})
      with F_k = (x_{k+1} − x_k)/dt_k the step's slope: for Euler the difference between
      Heun's step and Euler's (the local error estimate of embedded Heun–Euler), for any
      method the trajectory's second difference (on a uniform grid (x_{k+1} − 2x_k +
      x_{k-1})/2). Small when a finer solve would give the same x_K. Those K − 1 terms
      leave one step out, whose other slope the solve never evaluates:
    boundary_inputs: with local_error, the field's inputs (leaves [1, 1, ...]) at the time
      the solve never evaluates (Euler under step_time='start': t = 1; under 'end': 0),
      one more field evaluation that adds the left-out step's term: `boundary='end'`:
      e_K = dt_(K-1)/2·(f(x_K, boundary) − F_(K-1)), the last step's Heun–Euler error;
      'start': e_0 = dt_0/2·(F_0 − f(x_0, boundary)). None: the K − 1 terms alone.
    error_stride: s: the local error on every s-th row of x's leading axis (rows 0, s,
      2s, …; `every_nth_row`) only: an unbiased estimate of the mean over all rows at
      1/s of its cost (the boundary evaluation's field is then called on those rows).
      s must divide the leading axis.
    error_nodes: with local_error, the terms above (at the solve's nodes); False: the
      halves term alone.
    error_step: j (an int, or a traced int32 drawn per batch): add K·mean(d_j²), an
      unbiased estimate over a uniform j of Σ_k mean(d_k²), with d_j = dt_j/2·(f(x_j +
      dt_j/2·F_j, halves_inputs) − F_j), F_j step j's slope: for Euler at the step's
      start, the change that splitting step j into two Euler halves makes to x_(j+1) (that
      of the embedded midpoint–Euler pair). Where e_k compares a step with the one a
      coarser solve takes over two (what K/2 changes), d_j compares it with a finer
      solve's, through the field between the nodes, which e_k never reads. One field
      evaluation, on the error's rows.
    halves_inputs: with error_step, the field's inputs (leaves [1, 1, ...]) at t_j + dt_j/2.
  Returns:
    x_K, followed by [x_0 … x_{K-1}] with return_trajectory, by the outputs with
    eval_outputs and by the local error with local_error (a tuple when any is asked for).
  """
  if method not in STAGE_NODES:
    raise ValueError(f"unknown solver {method!r}; choose one of {sorted(STAGE_NODES)}")
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(
      f"unknown remat_policy {remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}"
    )
  scanned, rebuild = _split_constants(stage_inputs, len(STAGE_NODES[method]))
  step = _step(field, method, rebuild, eval_outputs)
  per_step = not isinstance(dt, (int, float))
  lengths = {
    a.shape[0] for a in scanned + jax.tree.leaves(eval_inputs) + ([dt] if per_step else [])
  }
  if num_steps is not None:
    lengths.add(num_steps)
  if not lengths:
    raise ValueError("no stage input has a step axis (every leaf is [1, 1, ...]); pass num_steps")
  if len(lengths) != 1:
    raise ValueError(
      f"the stage inputs, dt and num_steps disagree on the number of steps "
      f"({sorted(lengths)}); give them one K"
    )
  num_steps = lengths.pop()
  if per_step:
    dt = jnp.asarray(dt).astype(x0.dtype)
    if dt.shape != (num_steps,):
      raise ValueError(
        f"dt has shape {dt.shape}; expected a float or ({num_steps},), one step size per step"
      )
    xs = ((scanned, eval_inputs), dt)
  else:
    # A uniform dt stays a constant of the program (closed over, not traced).
    step = functools.partial(step, dt=dt)
    xs = (scanned, eval_inputs)
  if remat_policy != "none":
    step = jax.checkpoint(step, policy=REMAT_POLICIES[remat_policy])

  def body(x, xs_k):
    x_next, out = step(x, *xs_k) if per_step else step(x, xs_k)
    return x_next, ((x if return_trajectory else None), out)

  def results(x, traj, outs, *error):
    out = (x,) + ((traj,) if return_trajectory else ()) + ((outs,) if eval_outputs else ())
    return out + error if len(out + error) > 1 else x

  if not local_error:
    x, (traj, outs) = jax.lax.scan(body, x0, xs, length=num_steps, unroll=unroll)
    return results(x, traj, outs)

  if (error_step is None) != (halves_inputs is None):
    raise ValueError("error_step and halves_inputs go together: step j and its midpoint's inputs")
  if boundary not in ("start", "end"):
    raise ValueError(f"boundary={boundary!r}: choose 'start' or 'end'")
  parts = TABLEAUX[method].parts

  def whole(x, inputs):  # the whole field (a splitting method's parts summed) at one time
    _, rebuild_at = _split_constants(inputs, 1)
    at = rebuild_at([])
    if parts is None:
      return field(x, at)
    return sum(field(x, at, part=p) for p in dict.fromkeys(parts))

  rows = every_nth_row(error_stride)
  ends = boundary_inputs is not None and error_nodes
  # 'start': the first step's term is (x_1 − x_0) − dt_0·f(x_0, boundary), over 2.
  first = whole(rows(x0), boundary_inputs) if ends and boundary == "start" else None
  j = None if error_step is None else jnp.asarray(error_step, jnp.int32)

  def body_with_error(carry, xs_k):
    (x, x_prev, dt_prev, acc, started), kept = carry  # x_prev: the error's rows only
    k, xs_k = xs_k
    x_next, ys = body(x, xs_k)
    dt_k = xs_k[1] if per_step else dt
    x_rows, next_rows = rows(x), rows(x_next)
    if error_nodes:
      e = 0.5 * ((next_rows - x_rows) * (dt_prev / dt_k) - (x_rows - x_prev))
      e = e.astype(jnp.float32)
      if first is not None:
        e0 = 0.5 * ((next_rows - x_rows) - dt_k * first).astype(jnp.float32)
        e = jnp.where(started, e, e0)
        started = jnp.bool_(True)
      acc = acc + jnp.where(started, jnp.mean(jnp.square(e)), 0.0)
    if j is not None:  # step j's ends, on the error's rows
      kept = tuple(jnp.where(k == j, new, old) for new, old in zip((x_rows, next_rows), kept))
    return ((x_next, x_rows, dt_k, acc, jnp.bool_(True)), kept), ys

  dt0 = dt[0] if per_step else dt
  kept0 = (rows(x0), rows(x0)) if j is not None else ()
  init = ((x0, rows(x0), dt0, jnp.float32(0.0), jnp.bool_(False)), kept0)
  steps = jnp.arange(num_steps, dtype=jnp.int32)
  ((x, x_last, dt_last, error, _), kept), (traj, outs) = jax.lax.scan(
    body_with_error, init, (steps, xs), length=num_steps, unroll=unroll
  )
  if ends and boundary == "end":
    x_rows = rows(x)
    e = 0.5 * (dt_last * whole(x_rows, boundary_inputs) - (x_rows - x_last)).astype(jnp.float32)
    error = error + jnp.mean(jnp.square(e))
  if j is not None:
    (x_j, x_next_j), dt_j = kept, (xs[1][j] if per_step else dt)
    slope = (x_next_j - x_j) / dt_j
    d = 0.5 * dt_j * (whole(x_j + 0.5 * dt_j * slope, halves_inputs) - slope)
    error = error + num_steps * jnp.mean(jnp.square(d.astype(jnp.float32)))
  return results(x, traj, outs, error)
