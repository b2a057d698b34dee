"""AdamW with the paper's schedule, global-norm clipping and a weight-decay mask.

Schedule (paper App. C.4): linear warm-up over `optim.warmup_frac` of the run (1%),
then cosine decay to `optim.min_lr_ratio` × peak (0.1) at `num_train_steps`.

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

from odetransformer.errors import UserError


class OptimConfigError(UserError, ValueError):
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
DECAY_GROUPS = ("auto", "embeddings", "matrices")
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
  optim_config, num_train_steps: int, *, ode: bool = False
) -> optax.GradientTransformation:
  """The optax transformation: clip by global norm, then AdamW with the schedule.

  `ode` says whether the model is an ODE kind; it resolves `weight_decay_on='auto'`.
  """
  if optim_config.name != "adamw":
    raise OptimConfigError(f"optim.name={optim_config.name!r} is unknown; only 'adamw'")
  for key in ("b1", "b2"):
    if not 0.0 <= float(optim_config[key]) < 1.0:  # also refuses nan
      raise OptimConfigError(f"optim.{key}={optim_config[key]} must be in [0, 1)")
  if not 0 < float(optim_config.learning_rate) < math.inf:
    raise OptimConfigError(
      f"optim.learning_rate={optim_config.learning_rate} must be a finite number > 0, e.g. 3e-4"
    )
  for key in ("eps", "weight_decay", "grad_clip_norm", "warmup_frac", "min_lr_ratio"):
    value = optim_config.get(key)
    if value is not None and not 0 <= float(value) < math.inf:
      raise OptimConfigError(f"optim.{key}={value} must be a finite number >= 0")
  on = optim_config.get("weight_decay_on", "auto")
  if on not in DECAY_GROUPS:
    raise OptimConfigError(
      f"optim.weight_decay_on={on!r} is unknown; choose one of {list(DECAY_GROUPS)}"
    )
  if on == "auto":
    on = "embeddings" if ode else "matrices"
  schedule = learning_rate_schedule(optim_config, num_train_steps)
  parts = []
  if float(optim_config.grad_clip_norm) > 0:
    # Clips the gradient the train step hands over: under accumulation, the sum.
    parts.append(optax.clip_by_global_norm(float(optim_config.grad_clip_norm)))
  parts.append(
    optax.adamw(
      learning_rate=schedule,
      b1=float(optim_config.b1),
      b2=float(optim_config.b2),
      eps=float(optim_config.eps),
      weight_decay=float(optim_config.weight_decay),
      mask=functools.partial(weight_decay_mask, on=on),
    )
  )
  return optax.chain(*parts)
