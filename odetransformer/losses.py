"""Token-level cross-entropy in float32."""
import jax
import jax.numpy as jnp


def token_cross_entropy(logits_blv, targets_bl, weights_bl=None):
  """Returns (sum of weighted token NLL, sum of weights), in float32 (or wider)."""
  logits = logits_blv.astype(jnp.promote_types(logits_blv.dtype, jnp.float32))
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_bl[..., None], axis=-1)[..., 0]
  nll = logz - picked
  if weights_bl is None:
    weights_bl = jnp.ones_like(nll)
  weights_bl = weights_bl.astype(nll.dtype)
  return jnp.sum(nll * weights_bl), jnp.sum(weights_bl)
