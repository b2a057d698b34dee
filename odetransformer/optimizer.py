"""AdamW with the paper's schedule, global-norm clipping and a weight-decay mask.

Schedule (paper App. C.4): linear warm-up over `optim.warmup_frac` of the run (1%),
then cosine decay to `optim.min_lr_ratio` × peak (0.1) at `num_train_steps`.

Weight decay (decoupled, PyTorch-AdamW style: the decay is scaled by the learning rate)
applies to every parameter except:
  * norms and biases, by path name (`odetransformer.axes.is_decayed`: a path part
    containing 'norm', or named 'bias'/'bq'/'bk'/'bv'/'bo'/'b1'/'b2' or '<that>_...').
    For DiffEqFormer this also spares the generators of time-dependent biases and
    norm scales/shifts (`gens/bq/...`, `gens/norm1_scale/...`) and the hypernetwork
    MLPs that feed a norm group (`mlps/norm1/...`).
  * any parameter with fewer than 2 dimensions (a scale or bias under another name).
Embeddings (token and position), the LM head, the weight-matrix generators
(P and P0 of W_Q … W_2) and the kernels of the hypernetwork MLPs of linear layers are
decayed, as in GPT-2/nanoGPT, where the tied embedding is a weight matrix like the others.
"""
import math

import jax
import jax.numpy as jnp
import optax

from odetransformer.axes import is_decayed


class OptimConfigError(ValueError):
  """An optimizer setting that cannot work."""


def learning_rate_schedule(optim_config, num_train_steps: int):
  """Step -> learning rate: linear warm-up, then cosine (or constant) decay."""
  peak = float(optim_config.learning_rate)
  total = max(1, int(num_train_steps))
  warmup = max(1, int(round(float(optim_config.warmup_frac) * total)))
  floor = peak * float(optim_config.min_lr_ratio)
  kind = optim_config.schedule
  if kind not in ("cosine", "constant"):
    raise OptimConfigError(f"optim.schedule={kind!r} is unknown; choose 'cosine' or 'constant'")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * (step + 1.0) / warmup       # reaches the peak at step warmup-1
    if kind == "constant":
      after = jnp.asarray(peak, jnp.float32)
    else:
      progress = jnp.clip((step - warmup) / max(1, total - warmup), 0.0, 1.0)
      after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
    return jnp.where(step < warmup, warm, after)

  return schedule


def weight_decay_mask(params):
  """Tree of bools (True = decayed) matching `params`; see the module docstring."""
  def decide(path, x):
    return bool(is_decayed(path)) and getattr(x, "ndim", 0) >= 2
  return jax.tree_util.tree_map_with_path(decide, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm`, applied as one scalar factor min(1, max_norm/‖g‖).

  optax divides every element by ‖g‖; XLA counts a divide as expensive and will not
  duplicate it into AdamW's two consumers (μ and ν), so the clipped gradient is
  written out and read back: one extra pass over every parameter-sized array
  (a multiply is fused into the consumers instead). Equal to optax's result up to
  rounding; bit-identical when no clipping happens.

  The train step passes the norm it has already taken as the extra argument
  `global_norm` (its hypernetwork part comes from the backward pass, so that no
  reduction reads the hypernetworks' gradients); without it the norm is computed here.
  """
  def update_fn(updates, state, params=None, *, global_norm=None, **extra_args):
    del params, extra_args
    norm = optax.global_norm(updates) if global_norm is None else global_norm
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def create_optimizer(optim_config, num_train_steps: int) -> optax.GradientTransformation:
  """The optax transformation: clip by global norm, then AdamW with the schedule."""
  if optim_config.name != "adamw":
    raise OptimConfigError(f"optim.name={optim_config.name!r} is unknown; only 'adamw'")
  for key in ("b1", "b2"):
    if not 0.0 <= float(optim_config[key]) < 1.0:
      raise OptimConfigError(f"optim.{key}={optim_config[key]} must be in [0, 1)")
  if float(optim_config.learning_rate) <= 0:
    raise OptimConfigError(f"optim.learning_rate={optim_config.learning_rate} must be > 0")
  schedule = learning_rate_schedule(optim_config, num_train_steps)
  parts = []
  if float(optim_config.grad_clip_norm) > 0:
    parts.append(clip_by_global_norm(float(optim_config.grad_clip_norm)))
  parts.append(optax.adamw(
      learning_rate=schedule,
      b1=float(optim_config.b1),
      b2=float(optim_config.b2),
      eps=float(optim_config.eps),
      weight_decay=float(optim_config.weight_decay),
      mask=weight_decay_mask,
  ))
  return optax.chain(*parts)
