"""Materialisation: an ODE model at N Euler steps as an ordinary N-layer transformer.

W(t_k) is evaluated for k < N, and dt = 1/N is folded into the output projections
(W_O, W_2) and their biases, so x_{k+1} = x_k + layer_k(x_k) of the resulting discrete
parallel-block model equals x_k + dt·F(x_k, t_k) of the ODE. The result is a plain
`kind='parallel'` LanguageModel: the fast inference model, and the starting point for
fine-tuning with any method.
"""
import dataclasses

import jax.numpy as jnp

from odetransformer.model import LanguageModel, build_from_values
from odetransformer.solvers import stage_times

_DT_ROLES = ("out", "out_bias")


def materialize(model: LanguageModel, num_steps: int) -> LanguageModel:
  """Returns the `num_steps`-layer discrete parallel model equal to the N-step Euler solve."""
  cfg = model.config
  if not cfg.is_ode:
    raise ValueError(f"only ODE models materialise; this model is kind={cfg.kind!r}")
  if num_steps <= 0:
    raise ValueError(f"num_steps={num_steps} must be positive")
  dt = 1.0 / num_steps
  if cfg.kind == "diffeqformer":
    ts = stage_times(num_steps, "euler")[:, 0]
    layers = model.stack(ts, jnp.float32)
  else:
    layers = {n: jnp.broadcast_to(v, (num_steps,) + v.shape)
              for n, v in model.stack.layer().items()}
  specs = model.stack.specs
  layers = {n: (w * dt if specs[n].role in _DT_ROLES else w) for n, w in layers.items()}

  new_cfg = dataclasses.replace(cfg, kind="parallel", num_steps=num_steps)
  return build_from_values(new_cfg, layers, model)
