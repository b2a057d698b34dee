"""Learning-rate schedule, weight-decay mask and clipping."""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from odetransformer.errors import ConfigError
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import create_model
from odetransformer.train import optimizer
from odetransformer.train.run_config import OptimConfig


def _optim(**kw) -> OptimConfig:
  """configs/default.py's optimizer section with `kw` changed, typed (and checked)."""
  c = default.get_config().optim
  c.update(kw)
  return OptimConfig(**c.to_dict())


def test_schedule_warmup_peak_cosine_floor():
  sched = optimizer.learning_rate_schedule(
    _optim(learning_rate=1.0, warmup_frac=0.01, min_lr_ratio=0.1), 1000
  )
  lr = lambda s: float(sched(s))
  assert lr(0) == pytest.approx(0.1)  # (step + 1) / 10 warm-up steps
  assert lr(9) == pytest.approx(1.0)  # peak at the end of warm-up
  assert lr(10) == pytest.approx(1.0)
  assert lr(505) == pytest.approx(0.55, abs=1e-6)  # half-way down the cosine
  assert lr(1000) == pytest.approx(0.1)  # 0.1 × peak at the end
  assert lr(5000) == pytest.approx(0.1)
  assert all(lr(s) >= lr(s + 1) - 1e-7 for s in range(10, 1000, 7))


def test_constant_schedule_and_bad_names():
  sched = optimizer.learning_rate_schedule(_optim(schedule="constant", learning_rate=2.0), 100)
  assert float(sched(50)) == pytest.approx(2.0)
  with pytest.raises(ConfigError, match="optim.schedule='linear' is unknown"):
    _optim(schedule="linear")
  with pytest.raises(ConfigError, match=r"optim.b2=1.0 must be in \[0, 1\)"):
    _optim(b2=1.0)


def _mask_by_path(kind, family):
  cfg = ModelConfig(
    kind=kind,
    family=family,
    vocab_size=64,
    d_model=16,
    num_heads=2,
    mlp_dim=32,
    solver_steps=2,
    num_layers=2,
    max_len=16,
    time_embed_dim=4,
    time_sinusoids=4,
    remat_policy="none",
  )
  params = nnx.state(nnx.eval_shape(lambda: create_model(cfg, seed=0)), nnx.Param)  # shapes only
  mask = optimizer.weight_decay_mask(params)
  return {
    jax.tree_util.keystr(p).replace(".value", ""): m
    for p, m in jax.tree_util.tree_flatten_with_path(mask)[0]
  }


def test_weight_decay_mask_diffeqformer():
  m = _mask_by_path("diffeqformer", "gpt2")
  expect = {
    "['embed']": True,
    "['pos_embed']": True,
    "['final_norm_scale']": False,
    "['final_norm_shift']": False,
    # weight generators W(t) = P·h(t) + P0: decayed; bias and norm generators: not
    "['stack']['gens']['wq']['proj']": True,
    "['stack']['gens']['wq']['base']": True,
    "['stack']['gens']['w2']['proj']": True,
    "['stack']['gens']['bq']['proj']": False,
    "['stack']['gens']['b1']['base']": False,
    "['stack']['gens']['norm1_scale']['proj']": False,
    # hypernetwork MLPs: kernels decayed, biases not, a norm's MLP not at all
    "['stack']['mlps']['q']['fc1']['kernel']": True,
    "['stack']['mlps']['q']['fc1']['bias']": False,
    "['stack']['mlps']['norm1']['fc1']['kernel']": False,
  }
  for key, decayed in expect.items():
    assert m[key] == decayed, key


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_weight_decay_mask_discrete_baseline(family):
  m = _mask_by_path("transformer", family)
  assert m["['embed']"] and m["['stack']['params']['wq']"] and m["['stack']['params']['w2']"]
  assert not m["['stack']['params']['norm1_scale']"] and not m["['final_norm_scale']"]
  if family == "gpt2":
    assert not m["['stack']['params']['bq']"] and not m["['stack']['params']['b1']"]
  else:
    assert m["['stack']['params']['w3']"]


def test_decay_applies_only_to_masked_leaves():
  c = _optim(
    learning_rate=0.1, warmup_frac=0.0, weight_decay=0.5, grad_clip_norm=1.0, schedule="constant"
  )
  tx = optimizer.create_optimizer(c, 10)
  params = {"w": jnp.ones((2, 2)), "norm_scale": jnp.ones((2,))}
  state = tx.init(params)
  zero = jax.tree.map(jnp.zeros_like, params)
  upd, _ = tx.update(zero, state, params)
  np.testing.assert_allclose(upd["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_allclose(upd["norm_scale"], 0.0)


def test_gradients_above_the_clip_norm_are_scaled_down_to_it():
  """With eps = 1 Adam's first update, -lr·g/(|g| + eps), depends on g's scale; clipping
  at c makes every gradient above c act as g·c/‖g‖ (closed form), one below c as itself."""
  lr, clip = 0.1, 2.0
  c = _optim(
    learning_rate=lr,
    warmup_frac=0.0,
    weight_decay=0.0,
    grad_clip_norm=clip,
    eps=1.0,
    schedule="constant",
  )
  tx = optimizer.create_optimizer(c, 10)
  params = {"w": jnp.ones((2, 3)), "v": jnp.ones((4,))}
  rng = np.random.default_rng(0)
  g = {k: rng.normal(size=x.shape) for k, x in params.items()}
  norm = math.sqrt(sum(np.sum(x**2) for x in g.values()))

  def first_update(scale):
    grads = {k: jnp.asarray(x * scale, jnp.float32) for k, x in g.items()}
    upd, _ = tx.update(grads, tx.init(params), params)
    return upd

  for scale in (10.0, 1000.0):  # ‖g‖·scale > clip: clipped to norm `clip`
    upd = first_update(scale)
    for k, x in g.items():
      gc = x * clip / norm
      np.testing.assert_allclose(upd[k], -lr * gc / (np.abs(gc) + 1.0), rtol=1e-5)
  small = 0.5 / norm  # ‖g‖·small = 0.5 < clip: untouched
  upd = first_update(small)
  for k, x in g.items():
    np.testing.assert_allclose(upd[k], -lr * x * small / (np.abs(x * small) + 1.0), rtol=1e-5)


def test_optimizer_equals_float64_adamw_reference():
  """create_optimizer == clip → Adam (bias-corrected) → decoupled decay on the mask, in NumPy."""
  lr, b1, b2, eps, wd, clip = 0.01, 0.9, 0.95, 1e-8, 0.1, 1.0
  c = _optim(
    learning_rate=lr,
    warmup_frac=0.0,
    schedule="constant",
    b1=b1,
    b2=b2,
    eps=eps,
    weight_decay=wd,
    grad_clip_norm=clip,
  )
  tx = optimizer.create_optimizer(c, 10)
  rng = np.random.default_rng(1)
  params = {"w": rng.normal(size=(4, 3)), "bias": rng.normal(size=(3,))}
  decay = {"w": 1.0, "bias": 0.0}
  p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(p)
  ref = {k: v.copy() for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v2 = {k: np.zeros_like(v) for k, v in params.items()}
  for t, scale in enumerate((5.0, 0.05, 3.0), start=1):  # clipped, not clipped, clipped
    g = {k: rng.normal(size=x.shape) * scale for k, x in params.items()}
    upd, state = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, p)
    p = optax.apply_updates(p, upd)
    norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
    factor = min(1.0, clip / norm)
    for k in ref:
      gk = g[k] * factor
      m[k] = b1 * m[k] + (1 - b1) * gk
      v2[k] = b2 * v2[k] + (1 - b2) * gk**2
      step = (m[k] / (1 - b1**t)) / (np.sqrt(v2[k] / (1 - b2**t)) + eps)
      ref[k] = ref[k] - lr * (step + wd * decay[k] * ref[k])
    for k in ref:
      np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=2e-5, atol=1e-6)


def test_weight_decay_on_embeddings_decays_only_the_embeddings():
  """The authors' ODE group: token/position embeddings decay, nothing else does."""
  cfg = ModelConfig(
    vocab_size=64,
    d_model=16,
    num_heads=2,
    mlp_dim=32,
    solver_steps=2,
    num_layers=2,
    max_len=16,
    time_embed_dim=4,
    time_sinusoids=4,
    tie_embeddings=False,
  )
  params = nnx.state(nnx.eval_shape(lambda: create_model(cfg, seed=0)), nnx.Param)
  mask = optimizer.weight_decay_mask(params, on="embeddings")
  decayed = {
    jax.tree_util.keystr(p).replace(".value", "")
    for p, m in jax.tree_util.tree_flatten_with_path(mask)[0]
    if m
  }
  assert decayed == {"['embed']", "['pos_embed']", "['head']"}


@pytest.mark.parametrize("ode,decays_w", [(True, False), (False, True)])
def test_weight_decay_auto_follows_the_model_kind(ode, decays_w):
  """'auto': an ODE's weight generators are not decayed, a discrete model's weights are."""
  c = _optim(
    learning_rate=0.1, warmup_frac=0.0, weight_decay=0.5, grad_clip_norm=0.0, schedule="constant"
  )
  tx = optimizer.create_optimizer(c, 10, ode=ode)
  params = {"embed": jnp.ones((2, 2)), "w": jnp.ones((2, 2))}
  upd, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(upd["embed"], -0.05 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_allclose(upd["w"], -0.05 * np.ones((2, 2)) * decays_w, rtol=1e-6)
  with pytest.raises(ConfigError, match="weight_decay_on"):
    _optim(weight_decay_on="all")
