"""Parameter-free sinusoidal embedding of the layer time t ∈ [0, 1]."""

import math

import jax.numpy as jnp

TIME_SCALE = 1000.0  # t lives in [0, 1]; scaled so the sinusoids span many periods


def time_embedding(t, num_sinusoids: int, scale: float = TIME_SCALE):
  """e(t) = [t, sin(s·t·ω_i), cos(s·t·ω_i)]_{i<S}, ω_i = exp(-ln(10000)·i/S).

  Args:
    t: times, any shape [...].
    num_sinusoids: S.
    scale: s.
  Returns:
    [..., 2S+1] float32 embedding.
  """
  t = jnp.asarray(t, jnp.float32)
  omega = jnp.exp(-math.log(10000.0) * jnp.arange(num_sinusoids, dtype=jnp.float32) / num_sinusoids)
  angle = scale * t[..., None] * omega
  return jnp.concatenate([t[..., None], jnp.sin(angle), jnp.cos(angle)], axis=-1)
