"""Health checks of a training run: stop, in one line, when its values go non-finite.

A diverged run must not overwrite its good checkpoints: every save checks first, and the
error names the newest good step, which is left as it is.
"""

from collections.abc import Callable
import math

from absl import logging
import jax
import numpy as np

from odetransformer.errors import UserError


class DivergenceError(UserError, RuntimeError):
  """The loss became NaN or infinite (the settings are at fault: one line, exit 2)."""


_HEALTH = (("loss", "loss"), ("gradient norm", "grad_norm"))


class HealthCheck:
  """Stops the run (DivergenceError, one line) when training values go non-finite.

  `add` collects each step's TrainMetrics (device values); `check` fetches those since the
  last check in one transfer (no per-step host sync) and raises at the first step with a
  non-finite loss or gradient norm, or when `param_norm()` (of the parameters after the
  last pending step) is not finite. Every save checks first, with the norm of the
  parameters it would write, so `last_good` (the newest step saved) holds finite
  parameters; it is named in the message and left as it is.

  With `skip_limit` > 0 (optim.skip_nonfinite_steps) the train step skips non-finite steps
  itself; they are logged here, and more than `skip_limit` of them in a row stop the run.
  """

  def __init__(self, directory: str, last_good: int | None, skip_limit: int = 0, optim_config=None):
    self.directory, self.last_good, self.skip_limit = directory, last_good, skip_limit
    self.hint = divergence_hint(optim_config)
    self.pending = []  # (step, TrainMetrics) not yet checked
    self.skipped_from, self.skipped_in_a_row = None, 0  # the run of skips up to now

  def add(self, step: int, metrics):
    self.pending.append((step, metrics))

  def check(self, param_norm: Callable[[], float] | None = None):
    """Nothing pending (already checked at this step): nothing is measured."""
    if not self.pending:
      return
    values = jax.device_get(
      [
        ([getattr(m, attr).total for _, attr in _HEALTH], m.skipped_steps.total)
        for _, m in self.pending
      ]
    )
    for i, ((step, _), (row, skipped)) in enumerate(zip(self.pending, values)):
      bad = [
        (name, float(np.sum(v)))
        for (name, _), v in zip(_HEALTH, row)
        if not math.isfinite(float(np.sum(v)))
      ]
      if i == len(self.pending) - 1 and param_norm is not None:  # the parameters after it
        norm = param_norm()
        if not math.isfinite(norm):
          bad.append(("parameter norm", norm))
      if skipped:
        if not self.skipped_in_a_row:  # a new run of skips starts here
          self.skipped_from = step
        self.skipped_in_a_row += 1
        if jax.process_index() == 0:
          logging.warning("step %d skipped: non-finite loss or gradient (state unchanged)", step)
      else:
        self.skipped_in_a_row = 0
      if self.skipped_in_a_row > self.skip_limit:
        bad.append(
          (
            f"{self.skipped_in_a_row} steps in a row skipped from step "
            f"{self.skipped_from} on, more than optim.skip_nonfinite_steps="
            f"{self.skip_limit}",
            None,
          )
        )
      if bad:
        raise self._error(step, bad)
    self.pending.clear()

  def _error(self, step: int, bad: list) -> DivergenceError:
    kept = (
      f"last good checkpoint: step {self.last_good} in {self.directory} (left intact)"
      if self.last_good is not None
      else "no checkpoint was written yet"
    )
    what = ", ".join(name if value is None else f"{name} {value}" for name, value in bad)
    return DivergenceError(
      f"non-finite training values at step {step} ({what}); stopped; {kept}; {self.hint}"
    )


def divergence_hint(optim_config=None) -> str:
  """What to change after a divergence, from the run's `optim` settings (None: unknown)."""
  if optim_config is None:
    return "lower optim.learning_rate or set optim.grad_clip_norm"
  lr = f"lower optim.learning_rate (now {optim_config.learning_rate})"
  clip = optim_config.grad_clip_norm
  if clip <= 0:
    return f"{lr} or turn on clipping with optim.grad_clip_norm (e.g. 1.0; now off)"
  if optim_config.skip_nonfinite_steps <= 0:
    return (
      f"{lr}, lower optim.grad_clip_norm (now {clip:g}), or skip rare non-finite "
      "steps with optim.skip_nonfinite_steps (e.g. 3)"
    )
  return f"{lr} or lower optim.grad_clip_norm (now {clip:g})"
