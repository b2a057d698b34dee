"""Hand-written backwards against autodiff of the same formulas: the training loss
(`losses._nll`) and GPT-2's GELU (`blocks.gelu`), and their values against float64
references (what they compile to on an H100: tests/test_gpu_compile.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odetransformer.model import blocks
from odetransformer.train import losses


def autodiff_nll(logits, targets):
  """The formula `_nll` computes, differentiated by jax itself."""
  wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  picked = jnp.take_along_axis(wide, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(wide, axis=-1) - picked


def _inputs(dtype, b=3, length=5, vocab=37, seed=0):
  rng = np.random.default_rng(seed)
  logits = (3 * rng.standard_normal((b, length, vocab))).astype(np.float32)
  targets = rng.integers(0, vocab, (b, length)).astype(np.int32)
  weights = (rng.random((b, length)) > 0.3).astype(np.float32)
  return jnp.asarray(logits, dtype), jnp.asarray(targets), jnp.asarray(weights)


def test_values_equal_a_float64_reference():
  """token_cross_entropy (here, on a CPU, by autodiff's path) and the fused `_nll`."""
  logits, targets, weights = _inputs(jnp.float32)
  x = np.asarray(logits, np.float64)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  want = lse - np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
  total, count = losses.token_cross_entropy(logits, targets, weights)
  np.testing.assert_allclose(float(total), (want * np.asarray(weights)).sum(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(losses._nll(logits, targets)), want, rtol=1e-6)
  assert float(count) == float(np.asarray(weights).sum())


def test_one_pass_logsumexp_equals_numpy():
  rng = np.random.default_rng(1)
  x = (20 * rng.standard_normal((4, 1000))).astype(np.float32)
  x[1, :] = -np.inf  # a row of -inf: -inf, no NaN
  x[2, 7] = np.inf
  x[3, ::2] = -np.inf
  got = np.asarray(losses._logsumexp(jnp.asarray(x)))
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    m = np.max(x, -1, keepdims=True)
    want = np.log(np.sum(np.exp(x.astype(np.float64) - np.where(np.isfinite(m), m, 0)), -1))
    want = want + np.where(np.isfinite(m[:, 0]), m[:, 0], 0)
  want[1], want[2] = -np.inf, np.inf
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_gradient_equals_autodiff(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    logits, targets, weights = _inputs(dtype)

    def ours(x):  # the fused path (GPUs'), called directly: on a CPU the loss autodiffs
      return jnp.sum(losses._nll(x, targets) * weights)

    def theirs(x):
      return jnp.sum(autodiff_nll(x, targets) * weights)

    g_ours, g_theirs = jax.grad(ours)(logits), jax.grad(theirs)(logits)
    assert g_ours.dtype == logits.dtype
    tol = 1e-12 if dtype == jnp.float64 else 1e-6
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_theirs), rtol=tol, atol=tol)
    # Rows of weight 0 get no gradient; each weighted row's gradient sums to 0 (softmax
    # minus one-hot).
    rows = np.asarray(g_ours).sum(-1)
    np.testing.assert_allclose(rows, 0.0, atol=10 * tol)
    assert not np.asarray(g_ours)[np.asarray(weights) == 0].any()


def test_bfloat16_gradient_is_the_float32_math_rounded_once():
  """bfloat16 logits: d logits is the float32 softmax − one-hot rounded to bfloat16
  once (what autodiff gives before its final convert), in the logits' dtype."""
  logits, targets, weights = _inputs(jnp.bfloat16, vocab=301)
  g = jax.grad(lambda x: jnp.sum(losses._nll(x, targets) * weights))(logits)
  assert g.dtype == jnp.bfloat16
  want = jax.grad(lambda x: jnp.sum(autodiff_nll(x.astype(jnp.float32), targets) * weights))(
    logits.astype(jnp.float32)
  )
  np.testing.assert_array_equal(
    np.asarray(g, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32)
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_gelu_and_its_gradient_equal_jax_nn_gelu(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    x = jnp.asarray(np.linspace(-8, 8, 1001), dtype)
    # float32: both round terms of up to |0.0447·x³| ~ 23 at |x| = 8 (eps·23 ~ 3e-6).
    tol = 1e-12 if dtype == jnp.float64 else 1e-5
    ref = jax.nn.gelu(x, approximate=True)
    np.testing.assert_allclose(np.asarray(blocks.gelu(x)), np.asarray(ref), rtol=tol, atol=tol)
    g = jnp.asarray(np.cos(np.arange(1001)), dtype)  # an arbitrary cotangent
    ours = jax.vjp(blocks.gelu, x)[1](g)[0]
    theirs = jax.vjp(lambda x: jax.nn.gelu(x, approximate=True), x)[1](g)[0]
    assert ours.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=tol, atol=tol)


def test_gelu_derivative_equals_finite_differences():
  with jax.enable_x64(True):
    x = jnp.asarray(np.linspace(-5, 5, 41), jnp.float64)
    h = 1e-6
    fd = (blocks.gelu(x + h) - blocks.gelu(x - h)) / (2 * h)
    ours = jax.vmap(jax.grad(blocks.gelu))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(fd), rtol=1e-8, atol=1e-9)


def test_bfloat16_gelu_is_the_exact_value_rounded_once():
  xb = jnp.asarray(np.linspace(-6, 6, 513), jnp.bfloat16)
  x = np.asarray(xb, np.float64)
  exact = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  got = blocks.gelu(xb)
  assert got.dtype == jnp.bfloat16
  # One bfloat16 rounding (2**-8 relative), plus float32's cancellation in 1 + tanh(u)
  # for negative x (a few float32 ulps of 1, times |x| / 2 <= 3: under 1e-6 here).
  np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2**-8, atol=1e-6)


def autodiff_norm(x, scale, shift, eps, center=True):
  """The norm's formula (`blocks.norm`), differentiated by jax itself."""
  wide = jnp.promote_types(x.dtype, jnp.float32)
  y = x.astype(wide)
  if shift is not None and center:
    y = y - jnp.mean(y, axis=-1, keepdims=True)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + eps)
  y = y * scale.astype(wide)
  if shift is not None:
    y = y + shift.astype(wide)
  return y.astype(x.dtype)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "rms_plus_shift"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_norm_and_its_gradients_equal_autodiff(kind, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    rng = np.random.default_rng(2)
    x = jnp.asarray(3 + 2 * rng.standard_normal((2, 5, 48)), dtype)
    scale = jnp.asarray(1 + 0.3 * rng.standard_normal(48), dtype)
    shift = None if kind == "rmsnorm" else jnp.asarray(0.3 * rng.standard_normal(48), dtype)
    center = kind == "layernorm"
    g = jnp.asarray(rng.standard_normal(x.shape), dtype)  # an arbitrary cotangent

    def run(fn):
      args = (x, scale) if shift is None else (x, scale, shift)
      call = (
        (lambda x, s: fn(x, s, None, 1e-5, center))
        if shift is None
        else (lambda x, s, b: fn(x, s, b, 1e-5, center))
      )
      out, vjp = jax.vjp(call, *args)
      return out, vjp(g)

    (ours, d_ours), (theirs, d_theirs) = run(blocks.norm), run(autodiff_norm)
    tol = 1e-12 if dtype == jnp.float64 else 2e-5
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=tol, atol=tol)
    for a, b in zip(d_ours, d_theirs):
      assert a.dtype == b.dtype
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_norm_gradient_equals_finite_differences():
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float64)
    scale, shift = jnp.asarray(rng.standard_normal(16)), jnp.asarray(rng.standard_normal(16))
    w = jnp.asarray(rng.standard_normal((3, 16)))

    def f(x):
      return jnp.sum(w * blocks.norm(x, scale, shift, 1e-5))

    grad = np.asarray(jax.grad(f)(x))
    h, fd = 1e-6, np.zeros(x.shape)
    for i in np.ndindex(x.shape):
      e = jnp.zeros(x.shape).at[i].set(h)
      fd[i] = (f(x + e) - f(x - e)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
