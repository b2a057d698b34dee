"""A model's layer weights (along t, or per layer) and its vector field for one sequence.

The ODE kinds have weights at every t ∈ [0, 1] ('diffeqformer': W(t) from the
hypernetworks; 'shared': the same layer at every t). The discrete kinds ('transformer',
'parallel') have L layers, and their "vector field" is the per-layer residual update
with dt = 1, so x_{l+1} = x_l + F_l(x_l) is the same Euler recursion as the ODE's
x_{k+1} = x_k + dt·F(x_k, t_k). The analysis runs in float32 (or the dtype asked for),
whatever the model's compute dtype.
"""

from collections.abc import Callable
import dataclasses

from flax import nnx
import jax.numpy as jnp
import numpy as np

from odetransformer.model import blocks
from odetransformer.model.solvers import broadcast_stages, stage_times


@dataclasses.dataclass
class StepWeights:
  """Per-step layer params of the Euler recursion x_{k+1} = x_k + dt·F(x_k; weights[k])."""

  weights: dict  # name -> [K, *shape]
  dt: float  # 1/K for ODE kinds, 1 for discrete kinds
  times: np.ndarray  # [K]: t_k = k/K (ODE kinds) or the layer index (discrete kinds)
  axis_label: str  # 't' or 'layer'


def weights_at(model, ts, dtype=jnp.float32) -> dict:
  """Layer params at times `ts` [T] of an ODE model: name -> [T, *shape] (computed in
  float32, returned in `dtype`)."""
  if not model.config.is_ode:
    raise ValueError(f"kind={model.config.kind!r} has no weights along t; use layer_weights")
  ts = jnp.asarray(ts, jnp.float32)[:, None]
  # One compiled program instead of dozens of eagerly dispatched small ones.
  weights = nnx.jit(lambda stack, ts: stack.step_weights(ts, jnp.float32))(model.stack, ts)
  return {n: w[:, 0].astype(dtype) for n, w in broadcast_stages(weights, ts).items()}


def layer_weights(model, dtype=jnp.float32) -> dict:
  """The L layers of a discrete model: name -> [L, *shape]."""
  return model.layer_weights(dtype)


def euler_steps(model, num_steps: int | None = None, dtype=jnp.float32) -> StepWeights:
  """The weights of each Euler step: W(t_k) at t_k = k/K, or (k+1)/K under
  step_time='end' (ODE kinds; a split_euler step's too, its one stage time), or the
  layers."""
  cfg = model.config
  k = model.resolve_num_steps(num_steps)
  if cfg.is_ode:
    ts = stage_times(k, "euler", cfg.step_time)[:, 0]  # = split_euler's stage times
    return StepWeights(weights_at(model, ts, dtype), 1.0 / k, np.asarray(ts), "t")
  return StepWeights(layer_weights(model, dtype), 1.0, np.arange(k, dtype=np.float32), "layer")


def vector_field(cfg, length: int, dt: float | None = None) -> Callable:
  """F(x_ld; p) -> [l, d] for one causal sequence of `length` tokens at positions 0…l-1.

  The parallel block for ODE and 'parallel' models; GPT's sequential block returned as
  its residual update for 'transformer' models. No dropout. A 'split_euler' ODE at step
  size `dt`: the field whose Euler step is its split step, A(x) + F(x + dt·A(x)) (the
  attention part A, the MLP part F), as a sequential block is its layer's update.
  """
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  if cfg.is_ode and cfg.solver == "split_euler":
    if dt is None:
      raise ValueError("a split_euler model's step field needs its step size dt")
    attend, mlp = blocks.BLOCK_PARTS

    def split_field(x_ld, p):
      x = x_ld[None]
      a = attend(x, p, cfg, None, positions)
      return (a + mlp(x + dt * a, p, cfg))[0]

    return split_field
  block = blocks.block_fn(cfg)

  def field(x_ld, p):
    return block(x_ld[None], p, cfg, None, positions, None)[0]

  return field


def embed(model, tokens_l, dtype=jnp.float32):
  """The solver's initial state x0 [l, d] for one sequence (input scale included)."""
  tokens = jnp.asarray(tokens_l, jnp.int32)[None]
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  return model.embed_tokens(tokens, positions)[0].astype(dtype)
