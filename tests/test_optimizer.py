"""Learning-rate schedule, weight-decay mask and clipping."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import default
from odetransformer import optimizer
from odetransformer.config import ModelConfig
from odetransformer.model import create_model


def _optim(**kw):
  c = default.get_config().optim
  c.update(kw)
  return c


def test_schedule_warmup_peak_cosine_floor():
  sched = optimizer.learning_rate_schedule(
      _optim(learning_rate=1.0, warmup_frac=0.01, min_lr_ratio=0.1), 1000)
  lr = lambda s: float(sched(s))
  assert lr(0) == pytest.approx(0.1)            # (step + 1) / 10 warm-up steps
  assert lr(9) == pytest.approx(1.0)             # peak at the end of warm-up
  assert lr(10) == pytest.approx(1.0)
  assert lr(505) == pytest.approx(0.55, abs=1e-6)   # half-way down the cosine
  assert lr(1000) == pytest.approx(0.1)          # 0.1 × peak at the end
  assert lr(5000) == pytest.approx(0.1)
  assert all(lr(s) >= lr(s + 1) - 1e-7 for s in range(10, 1000, 7))


def test_constant_schedule_and_bad_names():
  sched = optimizer.learning_rate_schedule(_optim(schedule="constant", learning_rate=2.0), 100)
  assert float(sched(50)) == pytest.approx(2.0)
  with pytest.raises(optimizer.OptimConfigError):
    optimizer.learning_rate_schedule(_optim(schedule="linear"), 100)
  with pytest.raises(optimizer.OptimConfigError):
    optimizer.create_optimizer(_optim(b2=1.0), 100)


def _mask_by_path(kind, flavour):
  cfg = ModelConfig(kind=kind, flavour=flavour, vocab_size=64, d_model=16, num_heads=2,
                    mlp_dim=32, num_steps=2, max_len=16, time_embed_dim=4,
                    time_sinusoids=4, remat_policy="none")
  params = nnx.state(nnx.eval_shape(lambda: create_model(cfg, seed=0)), nnx.Param)  # shapes only
  mask = optimizer.weight_decay_mask(params)
  return {jax.tree_util.keystr(p).replace(".value", ""): m
          for p, m in jax.tree_util.tree_flatten_with_path(mask)[0]}


def test_weight_decay_mask_diffeqformer():
  m = _mask_by_path("diffeqformer", "gpt")
  expect = {
      "['embed']": True, "['pos_embed']": True,
      "['final_norm_scale']": False, "['final_norm_shift']": False,
      # weight generators W(t) = P·h(t) + P0: decayed; bias and norm generators: not
      "['stack']['gens']['wq']['proj']": True, "['stack']['gens']['wq']['base']": True,
      "['stack']['gens']['w2']['proj']": True,
      "['stack']['gens']['bq']['proj']": False, "['stack']['gens']['b1']['base']": False,
      "['stack']['gens']['norm1_scale']['proj']": False,
      # hypernetwork MLPs: kernels decayed, biases not, a norm's MLP not at all
      "['stack']['mlps']['q']['fc1']['kernel']": True,
      "['stack']['mlps']['q']['fc1']['bias']": False,
      "['stack']['mlps']['norm1']['fc1']['kernel']": False,
  }
  for key, decayed in expect.items():
    assert m[key] == decayed, key


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_weight_decay_mask_discrete_baseline(flavour):
  m = _mask_by_path("gpt", flavour)
  assert m["['embed']"] and m["['stack']['params']['wq']"] and m["['stack']['params']['w2']"]
  assert not m["['stack']['params']['norm1_scale']"] and not m["['final_norm_scale']"]
  if flavour == "gpt":
    assert not m["['stack']['params']['bq']"] and not m["['stack']['params']['b1']"]
  else:
    assert m["['stack']['params']['w3']"]


def test_decay_applies_only_to_masked_leaves_and_clipping_bounds_the_update():
  c = _optim(learning_rate=0.1, warmup_frac=0.0, weight_decay=0.5, grad_clip_norm=1.0,
             schedule="constant")
  tx = optimizer.create_optimizer(c, 10)
  params = {"w": jnp.ones((2, 2)), "norm_scale": jnp.ones((2,))}
  state = tx.init(params)
  zero = jax.tree.map(jnp.zeros_like, params)
  upd, _ = tx.update(zero, state, params)
  np.testing.assert_allclose(upd["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_allclose(upd["norm_scale"], 0.0)
  clipped = optimizer.clip_by_global_norm(1.0)
  g, _ = clipped.update({"w": jnp.full((2, 2), 100.0)}, clipped.init(None))
  assert float(optax.global_norm(g)) == pytest.approx(1.0, rel=1e-6)


def test_clip_by_global_norm_matches_optax():
  ours, ref = optimizer.clip_by_global_norm(2.0), optax.clip_by_global_norm(2.0)
  rng = np.random.default_rng(0)
  for scale in (0.01, 10.0):           # below the threshold (untouched), above (scaled)
    g = {"a": jnp.asarray(rng.normal(size=(3, 5)) * scale, jnp.float32),
         "b": jnp.asarray(rng.normal(size=(7,)) * scale, jnp.float32)}
    got, _ = ours.update(g, ours.init(g))
    want, _ = ref.update(g, ref.init(g))
    for k in g:
      if scale < 1:
        np.testing.assert_array_equal(got[k], want[k])
      else:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_optimizer_equals_float64_adamw_reference():
  """create_optimizer == clip → Adam (bias-corrected) → decoupled decay on the mask, in NumPy."""
  lr, b1, b2, eps, wd, clip = 0.01, 0.9, 0.95, 1e-8, 0.1, 1.0
  c = _optim(learning_rate=lr, warmup_frac=0.0, schedule="constant", b1=b1, b2=b2, eps=eps,
             weight_decay=wd, grad_clip_norm=clip)
  tx = optimizer.create_optimizer(c, 10)
  rng = np.random.default_rng(1)
  params = {"w": rng.normal(size=(4, 3)), "bias": rng.normal(size=(3,))}
  decay = {"w": 1.0, "bias": 0.0}
  p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(p)
  ref = {k: v.copy() for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v2 = {k: np.zeros_like(v) for k, v in params.items()}
  for t, scale in enumerate((5.0, 0.05, 3.0), start=1):   # clipped, not clipped, clipped
    g = {k: rng.normal(size=x.shape) * scale for k, x in params.items()}
    upd, state = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, p)
    p = optax.apply_updates(p, upd)
    norm = np.sqrt(sum(np.sum(x ** 2) for x in g.values()))
    factor = min(1.0, clip / norm)
    for k in ref:
      gk = g[k] * factor
      m[k] = b1 * m[k] + (1 - b1) * gk
      v2[k] = b2 * v2[k] + (1 - b2) * gk ** 2
      step = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
      ref[k] = ref[k] - lr * (step + wd * decay[k] * ref[k])
    for k in ref:
      np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=2e-5, atol=1e-6)
