"""Token scores in float32: the training loss and the one scorer every evaluation uses.

`token_cross_entropy` is the training loss (sums over the batch). `token_scores` scores
rows — negative log-likelihood, target count, argmax hits — for the train loop's
evaluation (pre-training and fine-tuning), `odetransformer.tools.evaluate` and the lm-eval
adapter alike, so they all measure the same thing.
"""

import jax
import jax.numpy as jnp

from odetransformer.model import blocks


@jax.custom_vjp
def _nll(logits_blv, targets_bl):
  """Per-token negative log-likelihood, in float32 (or wider), of logits in any dtype.

  The math is float32 inside the fused kernels, never a float32 copy of the logits: the
  forward reads them once in their own dtype (the softmax's max and sum), the backward
  writes d logits once, in the logits' dtype, from the logits and the saved log-sum-exp
  (softmax − one-hot, the one-hot an iota compare: no scatter into a [b, l, vocab]
  buffer). Autodiff of the same formula would keep a float32 copy of the bfloat16
  logits for the backward and write a float32 gradient before converting it; the
  values are the same (tests/test_custom_vjp.py checks them against autodiff).
  """
  return _nll_fwd(logits_blv, targets_bl)[0]


def _wide(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _logsumexp(x):
  """log Σ exp(x) over the last axis in one pass: a reduction of (running max, sum of
  exp(x − max)) pairs, so the logits are read once, not once for the max and again for
  the sum."""

  def combine(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    # Where a side holds the max its sum is kept as is (no exp(-inf - -inf)).
    scale_a = jnp.where(m_a == m, s_a, s_a * jnp.exp(m_a - m))
    scale_b = jnp.where(m_b == m, s_b, s_b * jnp.exp(m_b - m))
    return m, scale_a + scale_b

  init = (jnp.asarray(-jnp.inf, x.dtype), jnp.asarray(0, x.dtype))
  m, total = jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))
  return m + jnp.log(total)


def _picked(logits_blv, targets_bl):
  """The targets' logits [b, l]."""
  return jnp.take_along_axis(logits_blv, targets_bl[..., None], axis=-1)[..., 0]


def _nll_fwd(logits_blv, targets_bl):
  logits = _wide(logits_blv)
  lse = _logsumexp(logits)
  return lse - _picked(logits, targets_bl), (logits_blv, targets_bl, lse)


def _nll_bwd(residuals, g_bl):
  logits_blv, targets_bl, lse = residuals
  probs = jnp.exp(_wide(logits_blv) - lse[..., None])
  vocab = jax.lax.broadcasted_iota(targets_bl.dtype, logits_blv.shape, logits_blv.ndim - 1)
  d_nll = jnp.where(vocab == targets_bl[..., None], probs - 1, probs)  # softmax − one-hot
  d_logits = d_nll * g_bl[..., None].astype(probs.dtype)
  return d_logits.astype(logits_blv.dtype), None


_nll.defvjp(_nll_fwd, _nll_bwd)


def _nll_autodiff(logits_blv, targets_bl):
  """`_nll` by autodiff: the formula as written (two passes for the log-sum-exp, a
  gather and its scatter), which XLA:CPU keeps in less memory than `_nll`'s own
  backward (one logits-sized buffer fewer at its peak)."""
  logits = _wide(logits_blv)
  return jax.nn.logsumexp(logits, axis=-1) - _picked(logits, targets_bl)


def _token_nll(logits_blv, targets_bl):
  """Per-token NLL by the path that serves the platform the program is built for:
  `_nll`'s fused backward on GPUs, autodiff elsewhere (the same values)."""
  fused = blocks._platform() in ("cuda", "rocm")
  return (_nll if fused else _nll_autodiff)(logits_blv, targets_bl)


def _weights(weights_bl, like):
  return jnp.ones_like(like) if weights_bl is None else weights_bl.astype(like.dtype)


def token_cross_entropy(logits_blv, targets_bl, weights_bl=None):
  """Returns (sum of weighted token NLL, sum of weights), in float32 (or wider)."""
  nll = _token_nll(logits_blv, targets_bl)
  w = _weights(weights_bl, nll)
  return jnp.sum(nll * w), jnp.sum(w)


def token_scores(logits_blv, targets_bl, weights_bl=None) -> dict:
  """Per row [B]: 'nll' (Σ weighted token NLL), 'weight' (Σ weights), 'correct'
  (Σ weights of targets that are the argmax) and 'greedy' (every weighted target is
  the argmax: the continuation is what greedy decoding would produce)."""
  nll = _token_nll(logits_blv, targets_bl)
  w = _weights(weights_bl, nll)
  hit = jnp.argmax(logits_blv, axis=-1) == targets_bl
  return {
    "nll": jnp.sum(nll * w, -1),
    "weight": jnp.sum(w, -1),
    "correct": jnp.sum(hit * w, -1),
    "greedy": jnp.all(hit | (w == 0), -1),
  }
