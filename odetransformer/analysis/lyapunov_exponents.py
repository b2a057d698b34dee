"""Token sensitivity by finite-time Lyapunov exponents: the computation (paper §5.2, App. B).

How much does output position o depend on input token i? Along the model's own Euler
trajectory x_0 … x_{K-1} (x_{k+1} = x_k + dt·F(x_k, t_k)), evolve one tangent matrix
Q_i (d×d, Q_i = I at the start) per input token with the Jacobian block
J_{o,i}(t_k) = ∂F_o/∂x_i (x_k, t_k) of the vector field:

    Q_i ← Q_i + dt·J_{o,i}(t_k)·Q_i,   Q_i, R_i = qr(Q_i),   S_i += log|diag R_i|,

and report the exponents λ_i = S_i / (K·dt) (the total time: 1 for an ODE) and the
score max(λ_i). The Jacobian row block ∂F_o/∂x of all tokens at once is one `jax.vjp`
of F with d cotangents (what `jax.jacrev` does), sharing the forward pass that also
advances x; the per-token tangent update and QR are `vmap`ped over tokens. Tokens after
o do not reach it (causal attention): J_{o,i} = 0, λ_i = 0.

Discrete models ('transformer', 'parallel'): dt = 1 and F is the per-layer residual update, so
the total time and the divisor is the number of layers. A split_euler model is analysed
along its own trajectory: F is the field whose Euler step is its split step
(`fields.vector_field`), as a sequential layer's F is its update. Models trained with
midpoint or RK4 are analysed along the Euler solve at the same K (a warning says so).

For comparison the attention map: the attention of o to each token, averaged over heads
and steps (the usual attention-based explanation).

This module holds the numbers (`sensitivity` → `Sensitivity`); `lyapunov_report` turns
them into files and a summary, `lyapunov` is the command line.
"""

from collections.abc import Callable, Sequence
import dataclasses

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.analysis import fields
from odetransformer.model import blocks
from odetransformer.train import loading


def jacobian_row(field: Callable, x_ld, p, position: int, chunk: int | None = None):
  """(J [l, d, d] with J[i] = ∂F_o/∂x_i, F(x) [l, d]) at one state.

  `chunk` bounds memory: the d cotangents are pulled back `chunk` at a time
  (`jax.lax.map`) instead of all at once (`vmap`, i.e. `jax.jacrev`).
  """
  length, d = x_ld.shape
  f, pullback = jax.vjp(lambda x: field(x, p), x_ld)
  cotangents = (
    jax.nn.one_hot(position, length, dtype=f.dtype)[None, :, None]
    * jnp.eye(d, dtype=f.dtype)[:, None, :]
  )  # [d_out, l, d]
  pull = lambda ct: pullback(ct)[0]
  if chunk is None or chunk >= d:
    rows = jax.vmap(pull)(cotangents)
  else:
    rows = jax.lax.map(pull, cotangents, batch_size=chunk)
  return jnp.transpose(rows, (1, 0, 2)), f  # [l, d_out, d_in]


def _tangent_step(j_dd, q_dd, dt):
  """One token's Q ← qr(Q + dt·J·Q): (new Q, log|diag R|)."""
  q, r = jnp.linalg.qr(q_dd + dt * (j_dd @ q_dd))
  return q, jnp.log(jnp.abs(jnp.diagonal(r)))


def _tangent_steps(jac_ldd, q_ldd, dt):
  """`_tangent_step` of every token: one batched QR, or on CPU one QR per token.

  jaxlib's CPU QR kernel splits a batch of matrices over XLA:CPU's intra-op thread pool
  and blocks its own pool thread until the parts are done; when a sharded program runs
  it on as many devices as the pool has threads, every thread waits and none is left to
  do the parts (a deadlock). One matrix per call is computed on the calling thread.
  """
  if jax.default_backend() == "cpu":
    return jax.lax.map(lambda jq: _tangent_step(*jq, dt), (jac_ldd, q_ldd))
  return jax.vmap(_tangent_step, in_axes=(0, 0, None))(jac_ldd, q_ldd, dt)


def tangent_exponents(
  field: Callable, x0_ld, step_weights, dt: float, position: int, chunk: int | None = None
):
  """Finite-time Lyapunov exponents of every input token for output `position`.

  Args:
    field: F(x_ld, p) -> [l, d].
    x0_ld: initial state.
    step_weights: pytree whose leaves are [K, …]: the field's params at each step.
    dt: step size; the exponents are divided by the total time K·dt.
    position: output position o (negative counts from the end).
    chunk: see `jacobian_row`.
  Returns:
    (exponents [l, d] — token i's spectrum, in QR column order — and the trajectory
    [K, l, d] of states before each step).
  """
  length, d = x0_ld.shape
  o = position % length
  num_steps = jax.tree.leaves(step_weights)[0].shape[0]

  def body(carry, p):
    x, q, logs = carry
    jac, f = jacobian_row(field, x, p, o, chunk)
    q, log_r = _tangent_steps(jac, q, dt)
    return (x + dt * f, q, logs + log_r), x

  q0 = jnp.broadcast_to(jnp.eye(d, dtype=x0_ld.dtype), (length, d, d))
  logs0 = jnp.zeros((length, d), x0_ld.dtype)
  (_, _, logs), traj = jax.lax.scan(body, (x0_ld, q0, logs0), step_weights)
  return logs / (num_steps * dt), traj


def attention_to(cfg, x_ld, p, position: int):
  """Attention probabilities [heads, l] of query `position` over all keys at one state
  (the same computation as `blocks.attention`, with the softmax kept)."""
  length = x_ld.shape[0]
  o = position % length
  xn = blocks.block_norm(x_ld, p, "norm1", cfg)
  q = jnp.einsum("td,dnh->tnh", xn, p["wq"])
  k = jnp.einsum("td,dnh->tnh", xn, p["wk"])
  if "bq" in p:
    q, k = q + p["bq"], k + p["bk"]
  if cfg.family == "llama":
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    q = blocks.rope(q[None], pos, cfg.rope_base)[0]
    k = blocks.rope(k[None], pos, cfg.rope_base)[0]
  k = blocks.expand_kv_heads(k, cfg, axis=1)  # grouped-query attention: k per query head
  scores = jnp.einsum("nh,snh->ns", q[o], k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
  scores = jnp.where(jnp.arange(length)[None] <= o, scores, -jnp.inf)
  return jax.nn.softmax(scores, axis=-1)


@dataclasses.dataclass
class Sensitivity:
  """Lyapunov and attention maps of one output position over a token sequence."""

  tokens: np.ndarray  # [l] ids
  position: int  # o, in [0, l)
  exponents: np.ndarray  # [l, d] finite-time spectrum of each input token
  scores: np.ndarray  # [l] max exponent (the token's Lyapunov score)
  attention: np.ndarray  # [l] attention of o to each token, mean over heads and steps
  attention_steps: np.ndarray  # [K, heads, l]
  trajectory: np.ndarray  # [K, l, d] states x_k before each step
  dt: float
  num_steps: int
  times: np.ndarray  # [K] t_k, or layer indices
  axis_label: str


def sensitivity(
  model,
  tokens_l: Sequence[int],
  position: int = -1,
  num_steps: int | None = None,
  chunk: int | None = None,
  dtype=jnp.float32,
) -> Sensitivity:
  """Lyapunov scores and the attention map of output `position` for one token sequence."""
  cfg = model.config
  tokens = np.asarray(tokens_l, np.int32)
  length = int(tokens.shape[0])
  if length == 0:
    raise ValueError("no tokens to analyse")
  if not -length <= position < length:
    raise ValueError(f"position={position} is outside the {length} tokens")
  if cfg.is_ode and cfg.solver not in ("euler", "split_euler"):
    logging.warning(
      "model trained with solver=%r; analysing its Euler solve at K=%s steps",
      cfg.solver,
      num_steps or cfg.depth,
    )
  o = position % length
  steps = fields.euler_steps(model, num_steps, dtype)
  field = fields.vector_field(cfg, length, steps.dt)
  x0 = fields.embed(model, tokens, dtype)

  @jax.jit
  def run(x0, weights):
    exps, traj = tangent_exponents(field, x0, weights, steps.dt, o, chunk)
    att = jax.vmap(lambda x, p: attention_to(cfg, x, p, o))(traj, weights)
    return exps, att, traj

  exps, att, traj = run(x0, steps.weights)
  exps, att = loading.to_host(exps, np.float64), loading.to_host(att, np.float64)
  return Sensitivity(
    tokens=tokens,
    position=o,
    exponents=exps,
    scores=exps.max(-1),
    attention=att.mean(axis=(0, 1)),
    attention_steps=att,
    trajectory=loading.to_host(traj),
    dt=steps.dt,
    num_steps=len(steps.times),
    times=steps.times,
    axis_label=steps.axis_label,
  )
