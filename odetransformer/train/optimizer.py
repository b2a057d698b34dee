"""AdamW with the paper's schedule, global-norm clipping and a weight-decay mask.

Schedule (paper App. C.4): linear warm-up over `optim.warmup_frac` of the run (1%),
then cosine decay to `optim.min_lr_ratio` × peak (0.1) at `num_train_steps`.

`OptimConfig` (odetransformer/train/run_config.py) holds the settings, their defaults
and their checks.

Weight decay (decoupled, PyTorch-AdamW style: the decay is scaled by the learning rate)
applies to one of two groups, chosen by `optim.weight_decay_on`:
  * 'embeddings': the token and position embeddings and an untied LM head only. The
    authors' code (SDML-KU/qkvflow train_lm.py) decays exactly this group for its ODE
    models: the hypernetworks' generators are not decayed.
  * 'matrices': every parameter with ≥ 2 dimensions except norms and biases (by path
    name, `is_decayed`), as GPT-2/nanoGPT and the authors' GPT
    baselines do.
  * 'auto' (default): 'embeddings' for ODE kinds, 'matrices' for discrete ones.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax

from odetransformer.train.run_config import OptimConfig


def learning_rate_schedule(optim: OptimConfig, num_train_steps: int):
  """Step -> learning rate: linear warm-up, then cosine (or constant) decay."""
  peak = optim.learning_rate
  total = max(1, int(num_train_steps))
  warmup = max(1, int(round(optim.warmup_frac * total)))
  floor = peak * optim.min_lr_ratio
  kind = optim.schedule

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * (step + 1.0) / warmup  # reaches the peak at step warmup-1
    if kind == "constant":
      after = jnp.asarray(peak, jnp.float32)
    else:
      progress = jnp.clip((step - warmup) / max(1, total - warmup), 0.0, 1.0)
      after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
    return jnp.where(step < warmup, warm, after)

  return schedule


# Top-level model attributes that hold embeddings (odetransformer.model.transformer.LanguageModel).
EMBEDDINGS = ("embed", "pos_embed", "head")
# Parameters whose paths contain one of these are excluded from weight decay:
# norms and biases (time-dependent or not), and LoRA adapters.
NO_DECAY_NAMES = ("norm", "bias", "bq", "bk", "bv", "bo", "b1", "b2", "lora")


def is_decayed(path) -> bool:
  """Whether the parameter at `path` (tuple of keys) is in the 'matrices' group by name:
  not a norm, bias or LoRA adapter."""
  parts = [str(getattr(p, "key", p)) for p in path]
  for part in parts:
    if any(
      part == n or part.startswith(n + "_") or (n == "norm" and "norm" in part)
      for n in NO_DECAY_NAMES
    ):
      return False
  return True


def weight_decay_mask(params, on: str = "matrices"):
  """Tree of bools (True = decayed) matching `params`: the group `on` ('embeddings' or
  'matrices', see the module docstring)."""

  def decide(path, x):
    if on == "embeddings":
      return str(getattr(path[0], "key", path[0])) in EMBEDDINGS
    return bool(is_decayed(path)) and getattr(x, "ndim", 0) >= 2

  return jax.tree_util.tree_map_with_path(decide, params)


def create_optimizer(
  optim: OptimConfig, num_train_steps: int, *, ode: bool = False
) -> optax.GradientTransformation:
  """The optax transformation: clip by global norm, then AdamW with the schedule.

  `ode` says whether the model is an ODE kind; it resolves `weight_decay_on='auto'`.
  """
  on = optim.weight_decay_on
  if on == "auto":
    on = "embeddings" if ode else "matrices"
  parts = []
  if optim.grad_clip_norm > 0:
    # Clips the gradient the train step hands over: under accumulation, the sum.
    parts.append(optax.clip_by_global_norm(optim.grad_clip_norm))
  parts.append(
    optax.adamw(
      learning_rate=learning_rate_schedule(optim, num_train_steps),
      b1=optim.b1,
      b2=optim.b2,
      eps=optim.eps,
      weight_decay=optim.weight_decay,
      mask=functools.partial(weight_decay_mask, on=on),
    )
  )
  return optax.chain(*parts)
