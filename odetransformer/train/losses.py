"""Token scores in float32: the training loss and the one scorer every evaluation uses.

`token_cross_entropy` is the training loss (sums over the batch). `token_scores` scores
rows — negative log-likelihood, target count, argmax hits — for the train loop's
evaluation (pre-training and fine-tuning), `odetransformer.tools.evaluate` and the lm-eval
adapter alike, so they all measure the same thing.
"""

import jax
import jax.numpy as jnp


def _nll(logits_blv, targets_bl):
  """Per-token negative log-likelihood, in float32 (or wider)."""
  logits = logits_blv.astype(jnp.promote_types(logits_blv.dtype, jnp.float32))
  picked = jnp.take_along_axis(logits, targets_bl[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


def _weights(weights_bl, like):
  return jnp.ones_like(like) if weights_bl is None else weights_bl.astype(like.dtype)


def token_cross_entropy(logits_blv, targets_bl, weights_bl=None):
  """Returns (sum of weighted token NLL, sum of weights), in float32 (or wider)."""
  nll = _nll(logits_blv, targets_bl)
  w = _weights(weights_bl, nll)
  return jnp.sum(nll * w), jnp.sum(w)


def token_scores(logits_blv, targets_bl, weights_bl=None) -> dict:
  """Per row [B]: 'nll' (Σ weighted token NLL), 'weight' (Σ weights), 'correct'
  (Σ weights of targets that are the argmax) and 'greedy' (every weighted target is
  the argmax: the continuation is what greedy decoding would produce)."""
  nll = _nll(logits_blv, targets_bl)
  w = _weights(weights_bl, nll)
  hit = jnp.argmax(logits_blv, axis=-1) == targets_bl
  return {
    "nll": jnp.sum(nll * w, -1),
    "weight": jnp.sum(w, -1),
    "correct": jnp.sum(hit * w, -1),
    "greedy": jnp.all(hit | (w == 0), -1),
  }
