"""Materialisation: an ODE model at N Euler steps as an ordinary N-layer transformer.

W(t_k) is evaluated for k < N (t_k = k/N, or (k+1)/N under `model.step_time='end'`,
the same times as the model's Euler solve) and the step size dt = 1/N goes onto the output
projections (W_O, W_2) and their biases, so x_{k+1} = x_k + layer_k(x_k) of the
resulting discrete parallel-block model equals x_k + dt·F(x_k, t_k) of the ODE. A
'split_euler' ODE (`solvers.py`) materialises the same way into sequential pre-norm
blocks (`kind='transformer'`, GPT-2 or Llama): its step, x' = x + dt·Attn(N1(x)) then
x' + dt·FFN(N2(x')), is such a block with dt on W_O, W_2 and their biases. The result is
a plain discrete LanguageModel (`MATERIALIZED_KIND`), in one of two parameterisations of
the same function:

- `fold_dt=True` (inference): dt is multiplied into the stored W_O, W_2, b_O, b_2.
- `fold_dt=False` (fine-tuning): the stored weights are W(t_k) themselves and the model
  config's `out_proj_scale = dt` applies the step size in the forward pass. This is how
  the authors' code (SDML-KU/qkvflow, `evaluate_at`) fine-tunes: its layers' outputs are
  multiplied by dt. Training then means the same thing at every N: AdamW moves W_O by
  the same amounts whatever N is (with dt folded in, a step on dt·W_O is a step N times
  larger on W_O), and a LoRA update ΔW of W_O or W_2 lies under dt like W itself.
"""

import dataclasses

import jax.numpy as jnp

from odetransformer.model.solvers import broadcast_stages, stage_times
from odetransformer.model.transformer import LanguageModel

DT_ROLES = ("out", "out_bias")  # the output projections dt multiplies
# Solvers whose step is one discrete layer, and the discrete kind of that layer: Euler's
# x + dt·F(x) a parallel block, split_euler's two substeps a sequential pre-norm block.
MATERIALIZED_KIND = {"euler": "parallel", "split_euler": "transformer"}


def check_materializable(cfg, num_steps: int) -> None:
  """ValueError (one line) unless a model of config `cfg` materialises at `num_steps`."""
  if not cfg.is_ode:
    raise ValueError(f"only ODE models materialise; this model is kind={cfg.kind!r}")
  if cfg.solver not in MATERIALIZED_KIND:
    raise ValueError(
      f"only an Euler ODE ('euler' or 'split_euler') is N plain layers; this model's "
      f"solver is {cfg.solver!r} (decode it with decode.Decoder, fine-tune it with "
      "finetune.method='continuous')"
    )
  if num_steps <= 0:
    raise ValueError(f"num_steps={num_steps} must be positive")


def materialized_config(cfg, num_steps: int, fold_dt: bool = True):
  """The config of the discrete model `materialize` makes of a model of config `cfg`
  at `num_steps` (checked by `check_materializable`)."""
  check_materializable(cfg, num_steps)
  return dataclasses.replace(
    cfg,
    kind=MATERIALIZED_KIND[cfg.solver],
    num_layers=num_steps,
    out_proj_scale=1.0 if fold_dt else 1.0 / num_steps,
  )


def materialize(model: LanguageModel, num_steps: int, fold_dt: bool = True) -> LanguageModel:
  """Returns the `num_steps`-layer discrete model equal to the N-step Euler solve
  (parallel blocks) or split-Euler solve (sequential pre-norm blocks).

  Args:
    model: a DiffEqFormer or weight-sharing ODE solved with 'euler' or 'split_euler' (a
      midpoint or rk4 step is not one layer: it is refused).
    num_steps: N, the number of layers (dt = 1/N).
    fold_dt: multiply dt into the stored output projections (True), or store W(t_k)
      and set `out_proj_scale = dt` (False; see the module docstring).
  """
  cfg = model.config
  new_cfg = materialized_config(cfg, num_steps, fold_dt)
  dt = 1.0 / num_steps
  ts = stage_times(num_steps, cfg.solver, cfg.step_time)  # one stage: Euler's node
  weights = broadcast_stages(model.stack.step_weights(ts, jnp.float32), ts)
  layers = {n: w[:, 0] for n, w in weights.items()}
  if fold_dt:
    specs = model.stack.specs
    layers = {n: (w * dt if specs[n].role in DT_ROLES else w) for n, w in layers.items()}
  return model.with_layers(new_cfg, layers)
