"""Analysis tools: spectra, Lyapunov sensitivity, clustering simulation, and their CLIs."""

import dataclasses
import json
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odetransformer.analysis import clustering, fields, lyapunov, spectra
from odetransformer.model import blocks
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import create_model
from odetransformer.train import loop
from odetransformer.train.loading import load_model

from tiny import tiny_run_config

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = pytest.mark.xdist_group("test_analysis")

TINY = ModelConfig(
  vocab_size=61,
  d_model=16,
  num_heads=2,
  mlp_dim=24,
  solver_steps=3,
  num_layers=3,
  max_len=16,
  time_embed_dim=4,
  time_sinusoids=4,
  time_hidden=8,
  remat_policy="none",
)


# ----------------------------------------------------------------------------- models
def random_model(cfg: ModelConfig, seed: int):
  """A model of `cfg` with random params drawn in numpy (norm scales 1 + 0.1·N(0, 1),
  everything else 0.2·N(0, 1)). Initialising through `create_model` compiles one
  program per param shape, seconds per model on a small CPU; these tests need only a
  well-conditioned model, not the trained initialisation."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=seed)))
  rng = np.random.default_rng(seed)

  def fill(path, a):
    x = rng.normal(size=a.shape)
    x = 1.0 + 0.1 * x if "scale" in jax.tree_util.keystr(path) else 0.2 * x
    return jnp.asarray(x, a.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, shared_data_cache):
  """A DiffEqFormer (gpt family) trained for 2 steps on the embedded corpus (the config of
  test_evaluate's and test_lm_eval's runs: their programs come from the compilation
  cache)."""
  c = tiny_run_config(shared_data_cache)
  c.model.max_len = 64
  c.checkpoint_async = False
  wd = tmp_path_factory.mktemp("analysis_run")
  loop.train_and_evaluate(c, str(wd))
  return str(wd)


@pytest.fixture(scope="module")
def ode_model(workdir):
  return load_model(workdir).model


@pytest.fixture(scope="module")
def gpt_model():
  return random_model(dataclasses.replace(TINY, kind="transformer"), seed=1)


@pytest.fixture(scope="module")
def shared_llama_model():
  return random_model(dataclasses.replace(TINY, kind="shared", family="llama"), seed=2)


@pytest.fixture(scope="module")
def split_llama_model():
  """A DiffEqFormer solved by split_euler (an imported model's fit): its step is a
  sequential block, not the parallel field."""
  cfg = dataclasses.replace(TINY, kind="diffeqformer", family="llama", solver="split_euler")
  return random_model(cfg, seed=4)


MODELS = {
  "diffeqformer": "ode_model",
  "transformer": "gpt_model",
  "shared-llama": "shared_llama_model",
  "split-llama": "split_llama_model",
}


def _model(request, name):
  return request.getfixturevalue(MODELS[name])


def _f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ------------------------------------------------------------------------------ spectra
def _with_eigenvalues(rng, d, eigs):
  """(A [d, h], B [h, d]) with A @ B (d×d, rank h) having eigenvalues `eigs` and d − h
  zeros: A = U·M, B = U⁺ with M a real h×h matrix of spectrum `eigs`."""
  h = len(eigs)
  blocks_ = []
  k = 0
  while k < h:
    lam = eigs[k]
    if abs(np.imag(lam)) > 0:
      a, b = np.real(lam), np.imag(lam)
      blocks_.append(np.array([[a, -b], [b, a]]))
      k += 2
    else:
      blocks_.append(np.array([[np.real(lam)]]))
      k += 1
  m = np.zeros((h, h))
  i = 0
  for blk in blocks_:
    s = blk.shape[0]
    m[i : i + s, i : i + s] = blk
    i += s
  c = rng.normal(size=(h, h)) + 2 * np.eye(h)  # a similarity keeps the spectrum
  m = c @ m @ np.linalg.inv(c)
  u = rng.normal(size=(d, h))
  return u @ m, np.linalg.pinv(u)


def _sorted(e):
  e = np.asarray(e)
  return e[np.lexsort((np.round(np.imag(e), 6), np.round(np.real(e), 6)))]


def test_eigenvalues_of_constructed_products():
  rng = np.random.default_rng(0)
  d, n, h, t = 7, 2, 3, 2
  want_qk = [[1.5, 0.3 + 0.8j, 0.3 - 0.8j], [-2.0, 0.5, -0.25]]
  want_ov = [[0.9, -0.7, 0.2], [1.1 + 0.4j, 1.1 - 0.4j, -0.6]]
  w = {
    "wq": np.zeros((t, d, n, h)),
    "wk": np.zeros((t, d, n, h)),
    "wv": np.zeros((t, d, n, h)),
    "wo": np.zeros((t, n, h, d)),
  }
  for step in range(t):
    for head in range(n):
      scale = 1.0 + step  # a different spectrum at each t
      a, b = _with_eigenvalues(rng, d, [scale * e for e in want_qk[head]])
      w["wq"][step, :, head], w["wk"][step, :, head] = a, b.T  # W_Q W_Kᵀ = a @ b
      a, b = _with_eigenvalues(rng, d, [scale * e for e in want_ov[head]])
      w["wv"][step, :, head], w["wo"][step, head] = a, b  # W_V W_O = a @ b
  f = 5
  w["w1"] = rng.normal(size=(t, d, f))
  w["w2"] = rng.normal(size=(t, f, d))
  got = spectra.eigenvalues(w)
  assert got["qk"].shape == (t, n, h) and got["ov"].shape == (t, n, h)
  assert got["ff"].shape == (t, d)
  for step in range(t):
    for head in range(n):
      scale = 1.0 + step
      np.testing.assert_allclose(
        _sorted(got["qk"][step, head]), _sorted(scale * np.array(want_qk[head])), atol=1e-9
      )
      np.testing.assert_allclose(
        _sorted(got["ov"][step, head]), _sorted(scale * np.array(want_ov[head])), atol=1e-9
      )
      # Independently: the full d×d product's spectrum, less its d − h zeros.
      full = np.linalg.eigvals(w["wq"][step, :, head] @ w["wk"][step, :, head].T)
      full = full[np.argsort(np.abs(full))][d - h :]
      np.testing.assert_allclose(_sorted(got["qk"][step, head]), _sorted(full), atol=1e-8)
    ff = np.linalg.eigvals(w["w1"][step] @ w["w2"][step])
    np.testing.assert_allclose(_sorted(got["ff"][step]), _sorted(ff), atol=1e-9)
    # Sorted by descending real part.
    assert np.all(np.diff(np.real(got["ff"][step])) <= 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_model_spectra_match_per_head_products(request, name):
  model = _model(request, name)
  cfg = model.config
  res = spectra.compute_spectra(model, grid=5, chunk=3)  # grid in chunks of 3 and 2
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  if cfg.kind == "transformer":
    assert res.axis_label == "layer" and len(res.times) == cfg.depth
    weights = {k: np.asarray(v, np.float64) for k, v in model.layer_weights().items()}
  else:
    assert res.axis_label == "t" and len(res.times) == 5
    np.testing.assert_allclose(res.times, np.linspace(0, 1, 5), atol=1e-7)
    weights = {k: np.asarray(v, np.float64) for k, v in fields.weights_at(model, res.times).items()}
  assert res.qk.shape == res.ov.shape == (len(res.times), n, h)
  for s in range(len(res.times)):
    for head in range(n):
      qk = np.linalg.eigvals(weights["wq"][s][:, head] @ weights["wk"][s][:, head].T)
      ov = np.linalg.eigvals(weights["wv"][s][:, head] @ weights["wo"][s][head])
      for got, full in ((res.qk[s, head], qk), (res.ov[s, head], ov)):
        full = full[np.argsort(np.abs(full))][d - h :]
        np.testing.assert_allclose(_sorted(got), _sorted(full), rtol=1e-5, atol=1e-5)
    ff = np.linalg.eigvals(weights["w1"][s] @ weights["w2"][s])
    np.testing.assert_allclose(_sorted(res.ff[s]), _sorted(ff), rtol=1e-5, atol=1e-5)
  if cfg.kind == "shared":  # weight sharing: the same spectrum at every t
    np.testing.assert_allclose(res.qk, np.broadcast_to(res.qk[:1], res.qk.shape))
  spread = spectra.spread_along(res)
  assert all(np.all(np.isfinite(v)) and v.shape == (len(res.times),) for v in spread.values())
  assert "spectra" in spectra.summary_line(res)


# ---------------------------------------------------------------------------- Lyapunov
def _linear_field(x_ld, p):
  return x_ld @ p["a"].T


def _run_linear(a, dt, num_steps, length=3, position=1, chunk=None):
  d = a.shape[0]
  weights = {"a": jnp.broadcast_to(jnp.asarray(a, jnp.float32), (num_steps, d, d))}
  x0 = jax.random.normal(jax.random.key(0), (length, d))
  run = jax.jit(lambda x0, w: lyapunov.tangent_exponents(_linear_field, x0, w, dt, position, chunk))
  exps, _ = run(x0, weights)
  return np.asarray(exps, np.float64)


@pytest.mark.parametrize("chunk", [None, 3])  # Jacobian rows all at once, or 3 at a time
def test_lyapunov_linear_diagonal_is_exact_euler(chunk):
  lam = np.array([0.7, -0.4, 0.1, -1.3])
  dt, k = 0.05, 40
  exps = _run_linear(np.diag(lam), dt, k, chunk=chunk)
  # Diagonal A: Q stays I and each step multiplies column j by (1 + dt·λ_j).
  np.testing.assert_allclose(exps[1], np.log(np.abs(1 + dt * lam)) / dt, atol=1e-5)
  np.testing.assert_array_equal(exps[[0, 2]], 0.0)  # J_{o,i} = 0 for i ≠ o


def test_lyapunov_linear_ode_gives_real_parts_of_eigenvalues():
  rng = np.random.default_rng(3)
  lam = np.array([0.5 + 1.0j, 0.5 - 1.0j, -0.2, -0.9])
  blk = np.zeros((4, 4))
  blk[:2, :2] = [[0.5, -1.0], [1.0, 0.5]]
  blk[2, 2], blk[3, 3] = -0.2, -0.9
  u, _ = np.linalg.qr(rng.normal(size=(4, 4)))
  a = u @ blk @ u.T
  dt, k = 0.01, 20000  # T = 200: the finite-time transient is O(1/T)
  exps = np.sort(_run_linear(a, dt, k)[1])[::-1]
  euler = np.sort(np.log(np.abs(1 + dt * lam)) / dt)[::-1]
  np.testing.assert_allclose(exps, euler, atol=2e-2)
  np.testing.assert_allclose(exps, np.sort(np.real(lam))[::-1], atol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_jacobian_blocks_match_central_differences(request, name):
  model = _model(request, name)
  length, d, o, step = 5, model.config.d_model, 3, 1
  steps = fields.euler_steps(model)
  p32 = jax.tree.map(lambda w: w[step], steps.weights)
  x32 = fields.embed(model, jnp.arange(length) + 3)
  x32 = x32 + 0.3 * jax.random.normal(jax.random.key(1), x32.shape)
  field = fields.vector_field(model.config, length, steps.dt)
  with jax.enable_x64(True):  # the field in float64: central differences to ~1e-10
    p, x = jax.tree.map(jnp.asarray, _f64(p32)), jnp.asarray(_f64(x32))
    jac, f = jax.jit(lambda x: lyapunov.jacobian_row(field, x, p, o))(x)
    assert jac.dtype == jnp.float64 and jac.shape == (length, d, d)
    eps = 1e-5
    basis = jnp.eye(length * d, dtype=jnp.float64).reshape(length * d, length, d)
    f_o = jax.jit(jax.vmap(lambda dx: field(x + dx, p)[o]))
    fd = (f_o(eps * basis) - f_o(-eps * basis)) / (2 * eps)  # [(i, b), a]
    fd = np.asarray(fd).reshape(length, d, d).transpose(0, 2, 1)  # [i, a, b]
    np.testing.assert_allclose(np.asarray(jac), fd, rtol=1e-6, atol=1e-8)
    f_want = jax.jit(lambda x: field(x, p))(x)
    np.testing.assert_allclose(np.asarray(f), np.asarray(f_want), rtol=1e-12, atol=1e-12)
    assert np.all(np.asarray(jac)[o + 1 :] == 0.0)  # causal


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_sensitivity_follows_the_models_own_trajectory(request, name):
  model = _model(request, name)
  cfg = model.config
  tokens = np.array([5, 9, 2, 33, 7, 1, 12])
  res = lyapunov.sensitivity(model, tokens, position=4)
  _, want = model(jnp.asarray(tokens)[None], return_trajectory=True)
  np.testing.assert_allclose(res.trajectory, np.asarray(want)[:, 0], rtol=2e-5, atol=2e-5)
  assert res.position == 4 and res.exponents.shape == (7, cfg.d_model)
  assert res.dt == (1.0 if cfg.kind == "transformer" else 1.0 / cfg.depth)
  assert np.all(np.isfinite(res.scores)) and np.all(np.isfinite(res.attention))
  np.testing.assert_array_equal(res.exponents[5:], 0.0)  # tokens after o: no influence
  np.testing.assert_allclose(res.attention_steps.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(res.attention[5:], 0.0)
  assert res.attention_steps.shape == (cfg.depth, cfg.num_heads, 7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["diffeqformer", "shared-llama"])
def test_attention_map_reproduces_the_attention_output(request, name):
  model = _model(request, name)
  cfg = model.config
  length, o = 6, 4
  p = jax.tree.map(lambda w: w[0], fields.euler_steps(model).weights)
  x = fields.embed(model, jnp.arange(length) + 1)
  x = x + jax.random.normal(jax.random.key(2), x.shape)

  @jax.jit
  def outputs(x, p):
    probs = lyapunov.attention_to(cfg, x, p, o)  # [n, l]
    xn = blocks.norm(x, p["norm1_scale"], p.get("norm1_shift"), cfg.norm_eps)
    v = jnp.einsum("td,dnh->tnh", xn, p["wv"]) + (p["bv"] if "bv" in p else 0.0)
    out = jnp.einsum("ns,snh,nhd->d", probs, v, p["wo"]) + (p["bo"] if "bo" in p else 0.0)
    want = blocks.attention(xn[None], p, cfg, None, jnp.arange(length, dtype=jnp.int32)[None])[0, o]
    return probs, out, want

  probs, out, want = outputs(x, p)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(probs)[:, o + 1 :], 0.0)


def test_colour_scale_and_rank_correlation():
  u = lyapunov.colour_scale(np.array([1.0, 3.0, 2.0, 50.0, 9.0]), position=3)
  np.testing.assert_allclose(u[:4], [0.0, 1.0, 0.5, 1.0])  # o clipped to the top
  assert lyapunov.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert lyapunov.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  assert lyapunov.spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties
  assert math.isnan(lyapunov.spearman([1, 2, 3], [5, 5, 5]))


# -------------------------------------------------------------------------- clustering
def test_geshkovski_setting_forms_a_cluster():
  # Every case, as test_clustering_cli runs them: one program (from the compilation
  # cache for whichever runs second); each case is simulated on its own (vmapped), from
  # draws that do not depend on which other cases run.
  results = clustering.run_cases(list(clustering.CASES), seed=0, num_draws=2)
  ident = results["identity"]
  assert isinstance(ident.initial, float) and isinstance(ident.final, float)
  assert ident.initial > 1.0  # spread over the sphere at t = 0
  assert ident.final <= ident.initial / 10  # one cluster at t = T
  assert ident.final_clusters == 1
  assert ident.trajectory.shape == (clustering.NUM_STEPS + 1, clustering.NUM_TOKENS, 3)
  np.testing.assert_allclose(np.linalg.norm(ident.trajectory, axis=-1), 1.0, rtol=1e-5)
  poly = results["poly2"]
  np.testing.assert_allclose(
    poly.beta[[0, -1]], [1.0, 1.0 + 9.0 * (1 - 1 / clustering.NUM_STEPS) ** 2], rtol=1e-5
  )
  assert poly.final_draws.shape == (2,) and np.all(np.isfinite(poly.final_draws))
  numbers = ident.numbers()
  assert numbers["ratio_final_to_initial"] <= 0.1


def test_dispersion_measures():
  pts = np.array([[1.0, 0, 0], [1.0, 0, 0], [-1.0, 0, 0], [0, 1.0, 0]])
  assert clustering.num_clusters(pts) == 3
  assert clustering.mean_pairwise_distance(pts[:2]) == 0.0
  assert clustering.polarisation_gap(pts[:2]) == pytest.approx(0.0)
  assert clustering.polarisation_gap(pts[1:3]) == pytest.approx(1.0)
  two = np.array([[1.0, 0, 0], [0, 1.0, 0]])
  assert clustering.mean_pairwise_distance(two) == pytest.approx(math.sqrt(2))


@pytest.mark.slow
def test_spectra_cli(workdir, tmp_path, capsys):
  out = tmp_path / "spectra"
  res = spectra.main([f"--workdir={workdir}", f"--out={out}", "--grid=9"])
  printed = capsys.readouterr().out
  assert printed.startswith("spectra (diffeqformer")
  for name in (
    "spectra.npz",
    "spectra_summary.json",
    "spectra_qk.png",
    "spectra_ov.png",
    "spectra_ff.png",
  ):
    assert (out / name).stat().st_size > 0
  data = np.load(out / "spectra.npz")
  assert data["qk"].shape == (9, 2, 16) and data["ff"].shape == (9, 32)
  for key in ("qk", "ov", "ff", "qk_spread", "ov_spread", "ff_spread"):
    assert np.all(np.isfinite(data[key]))
  np.testing.assert_array_equal(data["qk"], res.qk)


@pytest.mark.slow
def test_lyapunov_cli(workdir, tmp_path, capsys):
  out = tmp_path / "lyap"
  res = lyapunov.main(
    [f"--workdir={workdir}", "--text=def add(a, b):\n    return a + b", f"--out={out}"]
  )
  assert capsys.readouterr().out.startswith("lyapunov: output position")
  for name in ("lyapunov.json", "lyapunov.npz", "lyapunov.html", "lyapunov.png"):
    assert (out / name).stat().st_size > 0
  with open(out / "lyapunov.json") as f:
    data = json.load(f)
  assert data["position"] == len(res.tokens) - 1 and data["num_steps"] == 3
  assert len(data["tokens"]) == len(res.tokens) > 3
  for tok in data["tokens"]:
    assert math.isfinite(tok["lyapunov"]) and math.isfinite(tok["attention"])
  assert sum(t["attention"] for t in data["tokens"]) == pytest.approx(1.0, rel=1e-4)
  pieces = "".join(t["piece"] for t in data["tokens"])
  assert "↵" in pieces and "\n" not in pieces  # newlines drawn as a glyph
  assert "<span" in (out / "lyapunov.html").read_text()


def test_clustering_cli(tmp_path, capsys):
  out = tmp_path / "clus"
  clustering.main([f"--out={out}", "--num_draws=2"])
  assert capsys.readouterr().out.startswith("clustering: mean pairwise distance")
  for name in ("clustering.json", "clustering.npz", "clustering.png", "clustering_dispersion.png"):
    assert (out / name).stat().st_size > 0
  with open(out / "clustering.json") as f:
    data = json.load(f)
  assert set(data["cases"]) == set(clustering.CASES)
  assert data["settings"]["dt"] == pytest.approx(0.05)
  for numbers in data["cases"].values():
    assert math.isfinite(numbers["final_dispersion"])
  assert data["cases"]["identity"]["ratio_final_to_initial"] <= 0.1
