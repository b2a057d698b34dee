"""DiffEqFormer model core: scan vs reference loop, materialisation, causality,
solver orders, finite-difference gradients, program size, init scale, baselines."""

import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

from odetransformer.model import blocks, solvers
from odetransformer.model.config import ModelConfig, default_model_config
from odetransformer.model.hypernet import generate_weights
from odetransformer.model.lora import Frozen, LoraParam, merge_lora
from odetransformer.model.materialize import materialize
from odetransformer.model.param_count import count_params, paper_config
from odetransformer.model.time_embedding import time_embedding
from odetransformer.model.transformer import create_model
from odetransformer.train.losses import token_cross_entropy

TINY = ModelConfig(
  vocab_size=97,
  d_model=32,
  num_heads=4,
  mlp_dim=64,
  solver_steps=4,
  num_layers=4,
  max_len=32,
  time_embed_dim=8,
  time_sinusoids=6,
  time_hidden=16,
  remat_policy="none",
)


def tokens(key=0, b=2, length=16, vocab=97):
  return jax.random.randint(jax.random.key(key), (b, length), 0, vocab)


@nnx.jit(static_argnames=("num_steps", "deterministic", "return_trajectory"))
def _jit_forward(model, toks, segment_ids_bl, positions_bl, dropout_rng, **static):
  return model(
    toks,
    segment_ids_bl=segment_ids_bl,
    positions_bl=positions_bl,
    dropout_rng=dropout_rng,
    **static,
  )


def forward(
  model,
  toks,
  *,
  segment_ids_bl=None,
  positions_bl=None,
  dropout_rng=None,
  num_steps=None,
  deterministic=True,
  return_trajectory=False,
):
  """`model(toks, ...)` compiled as one program per model structure and static arguments
  (num_steps, deterministic, return_trajectory): run op by op, each op of the model
  compiles on its own."""
  return _jit_forward(
    model,
    toks,
    segment_ids_bl,
    positions_bl,
    dropout_rng,
    num_steps=num_steps,
    deterministic=deterministic,
    return_trajectory=return_trajectory,
  )


# ---------------------------------------------------------------- numpy reference
def _np(x):
  return np.asarray(x, np.float64)


def ref_time_embedding(t, s, scale=1000.0):
  """e(t) = [t, sin(s·t·ω_i), cos(s·t·ω_i)], ω_i = 10000^(-i/S), s = `scale`, in float64."""
  omega = np.exp(-math.log(10000.0) * np.arange(s) / s)
  ang = scale * t * omega
  return np.concatenate([[t], np.sin(ang), np.cos(ang)])


def test_time_embedding_matches_closed_form():
  # The model forms its angles 1000·t·ω (up to 1000 rad) in float32: each of the ~4
  # roundings that make an angle moves it by ≤ 2⁻²⁴ of itself, and sin/cos move by as
  # much; the embedding must be the closed form up to that and float32 sin/cos.
  s = 64
  for t in (0.0, 1 / 3, 0.5, 0.8125, 1.0):
    got = np.asarray(time_embedding(jnp.float32(t), s), np.float64)
    want = ref_time_embedding(np.float64(np.float32(t)), s)
    ang = 1000.0 * t * np.exp(-math.log(10000.0) * np.arange(s) / s)
    bound = np.concatenate([[0.0], ang, ang]) * 4 * 2.0**-24 + 1e-6
    assert got.shape == (2 * s + 1,)
    assert np.all(np.abs(got - want) <= bound), (t, np.max(np.abs(got - want) - bound))


def test_the_time_scale_sets_the_hypernetworks_sinusoids():
  """model.time_scale s: the hypernetwork reads e(t) with angles s·t·ω_i (the closed form
  at s = 10, float32 rounding); at the default s = 1000 its weights differ."""
  s = 16
  for t in (0.1, 0.7):
    got = np.asarray(time_embedding(jnp.float32(t), s, 10.0), np.float64)
    np.testing.assert_allclose(
      got, ref_time_embedding(np.float64(np.float32(t)), s, 10.0), atol=1e-6
    )
  smooth = create_model(dataclasses.replace(TINY, time_scale=10.0), seed=3)
  default = create_model(TINY, seed=3)  # the same parameters
  t = jnp.asarray([[0.3]])
  for name, want in ref_weights(smooth, 0.3).items():
    np.testing.assert_allclose(
      np.asarray(smooth.stack.step_weights(t, jnp.float32)[name][0, 0]), want, rtol=1e-5, atol=1e-6
    )
  w_smooth = np.asarray(smooth.stack.step_weights(t, jnp.float32)["wq"])
  assert not np.allclose(w_smooth, np.asarray(default.stack.step_weights(t, jnp.float32)["wq"]))


def ref_weights(model, t):
  """W(t) for every layer param, from the hypernetwork's raw params, in float64, at the
  model's own float32 time embedding e(t) (checked against the closed form above: its
  float32 angles differ from exact ones by up to ~1e-4 rad, which moves f32 logits by
  ~1e-5, the tolerance of the comparisons that use this)."""
  hyper, cfg = model.stack, model.config
  e = np.asarray(time_embedding(jnp.float32(t), cfg.time_sinusoids, cfg.time_scale), np.float64)
  out = {}
  for name, spec in hyper.specs.items():
    mlp = hyper.mlp if hyper.shared else hyper.mlps[spec.group]
    hidden = e @ _np(mlp.fc1.kernel[...]) + _np(mlp.fc1.bias[...])
    hidden = hidden / (1.0 + np.exp(-hidden))
    code = hidden @ _np(mlp.fc2.kernel[...]) + _np(mlp.fc2.bias[...])
    proj = _np(hyper.gens[name].proj[...])  # [*shape, d_t]
    out[name] = proj @ code + _np(hyper.gens[name].base[...])
  return out


def ref_norm(x, scale, shift, eps):
  if shift is not None:
    x = x - x.mean(-1, keepdims=True)
  x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
  x = x * scale
  return x + shift if shift is not None else x


def ref_rope(x, pos, base):  # x [t, n, h]
  h = x.shape[-1]
  inv = 1.0 / base ** (np.arange(0, h, 2) / h)
  ang = pos[:, None] * inv
  sin, cos = np.sin(ang)[:, None], np.cos(ang)[:, None]
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def ref_field(x, w, cfg, seg, pos):
  """F(x) for one sequence x [t, d], with explicit loops over heads."""
  gpt = cfg.family == "gpt2"
  n1 = ref_norm(x, w["norm1_scale"], w.get("norm1_shift"), cfg.norm_eps)
  n2 = ref_norm(x, w["norm2_scale"], w.get("norm2_shift"), cfg.norm_eps)
  t = x.shape[0]
  q = np.einsum("td,dnh->tnh", n1, w["wq"])
  k = np.einsum("td,dnh->tnh", n1, w["wk"])
  v = np.einsum("td,dnh->tnh", n1, w["wv"])
  if gpt:
    q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
  else:
    q, k = ref_rope(q, pos, cfg.rope_base), ref_rope(k, pos, cfg.rope_base)
  allowed = np.tril(np.ones((t, t), bool))
  if seg is not None:
    allowed &= seg[:, None] == seg[None, :]
  scores = np.einsum("inh,jnh->nij", q, k) / math.sqrt(cfg.head_dim)
  scores = np.where(allowed[None], scores, -np.inf)
  prob = np.exp(scores - scores.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  attn = np.einsum("nij,jnh->inh", prob, v)
  a = np.einsum("tnh,nhd->td", attn, w["wo"]) + (w["bo"] if gpt else 0.0)
  if gpt:
    u = n2 @ w["w1"] + w["b1"]
    g = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    m = g @ w["w2"] + w["b2"]
  else:
    u = n2 @ w["w1"]
    m = (u / (1 + np.exp(-u)) * (n2 @ w["w3"])) @ w["w2"]
  return a + m


def ref_logits(model, toks, num_steps, seg=None, pos=None):
  cfg = model.config
  emb = _np(model.embed[...])
  out = []
  for b in range(toks.shape[0]):
    p = np.arange(toks.shape[1]) if pos is None else np.asarray(pos[b])
    sb = None if seg is None else np.asarray(seg[b])
    x = emb[np.asarray(toks[b])]
    if cfg.family == "gpt2":
      x = x + _np(model.pos_embed[...])[p]
    x = x * cfg.embed_scale
    dt = 1.0 / num_steps
    for step in range(num_steps):  # plain Python loop over solver steps
      t = np.float32(step) * np.float32(dt)  # the model's float32 time grid
      x = x + dt * ref_field(x, ref_weights(model, t), cfg, sb, p)
    shift = _np(model.final_norm_shift[...]) if cfg.family == "gpt2" else None
    x = ref_norm(x, _np(model.final_norm_scale[...]), shift, cfg.norm_eps)
    out.append(x @ emb.T)
  return np.stack(out)


@pytest.mark.matmul_precision("highest")
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("shared_mlp", [False, True])
def test_scan_matches_reference_loop(family, shared_mlp):
  cfg = dataclasses.replace(TINY, family=family, shared_time_mlp=shared_mlp)
  model = create_model(cfg, seed=1)
  _perturb_hypernet(model)
  toks = tokens(b=2, length=10)
  seg = jnp.array([[1] * 6 + [2] * 4, [1] * 10])
  pos = jnp.array([list(range(6)) + list(range(4)), list(range(10))])
  got = forward(model, toks, segment_ids_bl=seg, positions_bl=pos, num_steps=3)
  want = ref_logits(model, toks, 3, seg, pos)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _perturb_hypernet(model, scale=0.3, seed=7):
  """Gives zero-initialised generators (biases, norms) non-zero values so tests see them."""
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [
    x + scale * jax.random.normal(k, x.shape, x.dtype) / math.sqrt(max(x.shape[-1], 1))
    for x, k in zip(leaves, keys)
  ]
  nnx.update(model, jax.tree.unflatten(tree, leaves))


@pytest.mark.matmul_precision("highest")
@pytest.mark.slow
@pytest.mark.parametrize(
  "family,options",
  [
    ("gpt2", {}),
    ("llama", {}),
    ("gpt2", {"step_time": "end"}),
    ("llama", {"step_time": "end", "llama_block": "reference"}),
  ],
)
def test_materialized_equals_euler_solve(family, options):
  cfg = dataclasses.replace(TINY, family=family, **options)
  model = create_model(cfg, seed=2)
  _perturb_hypernet(model)
  toks = tokens(3)
  for n in (3, 7):  # neither is the config default (4)
    ode = model(toks, num_steps=n)
    disc = materialize(model, n)
    assert disc.config.kind == "parallel" and disc.config.depth == n
    np.testing.assert_allclose(np.asarray(disc(toks)), np.asarray(ode), atol=1e-5, rtol=1e-5)


@pytest.mark.matmul_precision("highest")
def test_materialized_shared_equals_solve():
  model = create_model(dataclasses.replace(TINY, kind="shared"), seed=3)
  _perturb_hypernet(model)
  toks = tokens(4)
  np.testing.assert_allclose(
    np.asarray(materialize(model, 5)(toks)),
    np.asarray(model(toks, num_steps=5)),
    atol=1e-5,
    rtol=1e-5,
  )


@pytest.mark.parametrize("solver", ["midpoint", "rk4"])
def test_materialising_a_higher_order_ode_is_refused(solver):
  """N parallel layers are N Euler steps: a midpoint/rk4 model is not materialised
  into a different function. (The model's structure carries its config: no values needed.)"""
  model = nnx.eval_shape(lambda: create_model(dataclasses.replace(TINY, solver=solver), seed=2))
  with pytest.raises(ValueError, match=f"solver is '{solver}'"):
    materialize(model, 4)


def split_euler_as_blocks(model, num_steps, time_grid=None):
  """What a split_euler DiffEqFormer at `num_steps` (or on `time_grid`) is claimed to
  be, built by hand (not by `materialize`): a discrete kind='transformer' model
  (sequential pre-norm blocks, the same family) whose layer k holds W(t_k) with W_O,
  W_2 and their biases multiplied by step k's dt. t_k is the step's start, or its end
  under step_time='end' (float32, as the model's time grid)."""
  cfg = model.config
  end = cfg.step_time == "end"
  if time_grid is None:  # (k + 0 or 1)·(1/N), the model's float32 times
    ts = (np.arange(num_steps, dtype=np.float32) + np.float32(end)) * np.float32(1 / num_steps)
    dts = np.full((num_steps,), 1 / num_steps, np.float32)
  else:
    grid = np.asarray(time_grid, np.float32)
    ts, dts = (grid[1:] if end else grid[:-1]), np.diff(grid)
  layers = {}
  for name, w in model.stack.step_weights(jnp.asarray(ts)[:, None], jnp.float32).items():
    w = w[:, 0]
    if model.stack.specs[name].role in ("out", "out_bias"):
      w = w * dts.reshape((-1,) + (1,) * (w.ndim - 1))
    layers[name] = w
  return model.with_layers(
    dataclasses.replace(cfg, kind="transformer", num_layers=num_steps), layers
  )


@nnx.jit(static_argnames=("num_steps",))
def _jit_trajectory(model, toks, time_grid=None, num_steps=None):
  return model(toks, num_steps=num_steps, time_grid=time_grid, return_trajectory=True)


def _max_rel_error(got, want):
  """max |got - want| / max |want|."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize(
  "family,options",
  [
    ("llama", {"num_kv_heads": 2}),  # grouped-query attention, step_time 'start'
    ("gpt2", {"step_time": "end", "remat_policy": "full", "layer_loop": "unrolled"}),
  ],
)
def test_split_euler_is_sequential_blocks_with_dt_on_the_output_projections(family, options):
  """A split_euler DiffEqFormer at N steps (uniform, and on a graded grid: dt per step)
  equals, logits and trajectory, the discrete sequential-block model of the same family
  whose layer k is W(t_k) with W_O, W_2 (and biases) times dt_k; `materialize` gives
  that model (kind 'transformer'). Float32 rounding apart: ≤ 1e-5 of the largest logit."""
  cfg = dataclasses.replace(TINY, family=family, solver="split_euler", **options)
  model = create_model(cfg, seed=8)
  _perturb_hypernet(model)
  toks = tokens(9)
  n = 3
  for grid in (None, jnp.asarray([0.0, 0.2, 0.6, 1.0])):
    logits, traj = _jit_trajectory(model, toks, grid, num_steps=n)
    want, want_traj = _jit_trajectory(split_euler_as_blocks(model, n, grid), toks)
    err = _max_rel_error(logits, want)
    print(f"split_euler vs blocks ({family}, grid={grid is not None}): max|Δlogit|/max = {err:.2e}")
    assert err <= 1e-5 and _max_rel_error(traj, want_traj) <= 1e-5
  disc = materialize(model, n)
  assert disc.config.kind == "transformer" and disc.config.block == "sequential"
  err = _max_rel_error(forward(disc, toks), forward(model, toks, num_steps=n))
  print(f"materialize vs split_euler ({family}): max|Δlogit|/max = {err:.2e}")
  assert err <= 1e-5


@pytest.mark.parametrize("zero", [("w2", "b2"), ("wo", "bo")])
def test_split_euler_with_a_zero_part_is_euler(zero):
  """With the MLP's (or the attention's) output projection zero at every t, one part of
  the field is zero, and split_euler is Euler: at N = 1 and at N = 3."""
  models = {}
  for solver in ("euler", "split_euler"):
    models[solver] = create_model(dataclasses.replace(TINY, solver=solver), seed=10)
    _perturb_hypernet(models[solver])
    for name in zero:
      gen = models[solver].stack.gens[name]
      gen.proj[...], gen.base[...] = jnp.zeros_like(gen.proj[...]), jnp.zeros_like(gen.base[...])
  toks = tokens(11)
  for n in (1, 3):
    euler = np.asarray(forward(models["euler"], toks, num_steps=n))
    np.testing.assert_allclose(
      np.asarray(forward(models["split_euler"], toks, num_steps=n)), euler, rtol=0, atol=1e-6
    )
  assert np.abs(euler).max() > 1e-3  # the other part is not zero too


KINDS = [
  ("diffeqformer", "gpt2"),
  ("diffeqformer", "llama"),
  ("transformer", "gpt2"),
  ("transformer", "llama"),
  ("parallel", "gpt2"),
  ("shared", "llama"),
]


@pytest.mark.slow
@pytest.mark.matmul_precision("highest")  # the float32 pack-vs-alone comparison
@pytest.mark.parametrize("kind,family", KINDS)
def test_causality_and_segments(kind, family):
  model = create_model(dataclasses.replace(TINY, kind=kind, family=family), seed=4)
  _perturb_hypernet(model)
  toks = tokens(5, b=1, length=12)
  base = np.asarray(forward(model, toks))
  for j in (0, 5, 11):
    changed = np.asarray(forward(model, toks.at[0, j].set((toks[0, j] + 1) % 97)))
    np.testing.assert_array_equal(changed[0, :j], base[0, :j])
    assert np.abs(changed[0, j:] - base[0, j:]).max() > 1e-6
  # Two packed documents: editing the first never changes the second's logits.
  seg = jnp.array([[1] * 5 + [2] * 7])
  pos = jnp.array([list(range(5)) + list(range(7))])
  a = np.asarray(forward(model, toks, segment_ids_bl=seg, positions_bl=pos))
  b = np.asarray(
    forward(model, toks.at[0, 2].set((toks[0, 2] + 3) % 97), segment_ids_bl=seg, positions_bl=pos)
  )
  np.testing.assert_array_equal(a[0, 5:], b[0, 5:])
  # ... and the second document alone gives the same logits as inside the pack.
  alone = np.asarray(forward(model, toks[:, 5:]))
  np.testing.assert_allclose(a[0, 5:], alone[0], atol=1e-5, rtol=1e-5)


def linear_ode_problem():
  """dx/dt = cos(t)·A0 x (A(t) commutes with itself): (field, x0, x(1) = expm(sin(1)·A0) x0),
  float64 (call under `jax.enable_x64`)."""
  a0 = jnp.array([[-0.5, 2.0], [-2.0, -0.5]], jnp.float64)
  x0 = jnp.array([1.0, 0.3], jnp.float64)
  lam, vec = np.linalg.eig(np.asarray(a0))
  exact = (vec @ np.diag(np.exp(np.sin(1.0) * lam)) @ np.linalg.inv(vec)).real @ np.asarray(x0)
  return (lambda x, t: jnp.cos(t) * (a0 @ x)), x0, exact


@pytest.mark.parametrize("step_time", ["start", "end"])
@pytest.mark.parametrize("method,order", [("euler", 1), ("midpoint", 2), ("rk4", 4)])
def test_solver_order(method, order, step_time):
  """dx/dt = A(t) x with A(t) = cos(t)·A0 (commuting): x(1) = expm(sin(1)·A0) x0, at the
  method's order under both step-time conventions."""
  with jax.enable_x64(True):
    field, x0, exact = linear_ode_problem()
    errors = []
    for k in (8, 16, 32, 64):
      ts = solvers.stage_times(k, method, step_time).astype(jnp.float64)
      x1 = solvers.fixed_step_solve(field, x0, ts, 1.0 / k, method)
      errors.append(np.linalg.norm(np.asarray(x1) - exact))
    rates = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    np.testing.assert_allclose(rates, order, atol=0.15)


def split_ode_problem():
  """dx/dt = A x + B x with A, B that do not commute (AB - BA != 0): (A, B, x0, x(1) =
  expm(A + B) x0), float64 (call under `jax.enable_x64`)."""
  a = np.array([[-0.5, 2.0], [-2.0, -0.5]])
  b = np.array([[0.3, 0.0], [1.0, -0.8]])
  assert np.abs(a @ b - b @ a).max() > 0.5
  x0 = np.array([1.0, 0.3])
  return a, b, x0, scipy.linalg.expm(a + b) @ x0


def _split_solve(parts, x0, k, step_time="start", grid=None, method="split_euler"):
  """`fixed_step_solve` of dx/dt = Σ parts[i](t)·x by `method` (split_euler calls the
  field with part=i; the others evaluate the whole field), on the uniform grid of k
  steps or on `grid`."""

  def field(x, t, part=None):
    ms = parts if part is None else parts[part : part + 1]
    return sum(m(t) @ x for m in ms)

  ts, dt = solvers.solve_times(k, method, step_time, None if grid is None else jnp.asarray(grid))
  return np.asarray(
    # num_steps: at k = 1 the times [1, 1] would read as the same at every step
    solvers.fixed_step_solve(
      field, jnp.asarray(x0), ts.astype(jnp.float64), dt, method, num_steps=k
    )
  )


@pytest.mark.parametrize(
  "step_time,graded,time_dependent",
  [("start", False, False), ("end", False, False), ("start", True, True), ("end", False, True)],
)
def test_split_euler_order(step_time, graded, time_dependent):
  """Lie–Trotter splitting of dx/dt = A x + B x (non-commuting) is first order: the
  error at t = 1 halves with dt. Against expm(A + B) x0 for constant parts; for A(t) =
  (1 + t)·A (where 'start' and 'end' differ) against RK4 at 2048 steps. On the uniform
  grid and on a graded one (per-step dt)."""
  with jax.enable_x64(True):
    a, b, x0, exact = split_ode_problem()
    parts = [lambda t: (1.0 + t) * a if time_dependent else a + 0.0 * t, lambda t: b + 0.0 * t]
    if time_dependent:
      exact = _split_solve(parts, x0, 2048, method="rk4")
    errors = []
    for k in (32, 64, 128, 256):
      u = np.arange(k + 1) / k
      grid = (u + u * u) / 2 if graded else None
      errors.append(np.linalg.norm(_split_solve(parts, x0, k, step_time, grid) - exact))
    orders = np.log2(np.array(errors[:-1]) / np.array(errors[1:]))
    print(f"split_euler orders ({step_time}, graded={graded}, A(t)={time_dependent}): {orders}")
    assert np.all((orders >= 0.9) & (orders <= 1.1)), (orders, errors)


def test_split_euler_steps_the_first_part_first():
  """One step is an Euler substep of part 0, then one of part 1 from the updated state:
  (I + B)(I + A) x0 at N = 1, and (I + B/N)(I + A/N) per step at N. With part 1 (or
  part 0) zero it is Euler, bit for bit, at any N."""
  with jax.enable_x64(True):
    a, b, x0, _ = split_ode_problem()
    eye, const = np.eye(2), (lambda m: lambda t: m + 0.0 * t)
    for k in (1, 3):
      step = (eye + b / k) @ (eye + a / k)
      np.testing.assert_allclose(
        _split_solve([const(a), const(b)], x0, k), np.linalg.matrix_power(step, k) @ x0, rtol=1e-14
      )
      for parts in ([const(a), const(0 * b)], [const(0 * a), const(b)]):
        np.testing.assert_array_equal(
          _split_solve(parts, x0, k), _split_solve(parts, x0, k, method="euler")
        )


@pytest.mark.matmul_precision("highest")
def test_solver_broadcasts_constant_inputs_and_returns_evaluation_outputs():
  """A [1, 1] stage input (a weight-shared layer) is the same at every stage, closed over
  rather than copied K·S times: the solve equals the one with the input copied to
  [K, S]. Per-evaluation outputs come back [K, E] (the first evaluation of step k sees
  x_k). Inputs of another leading shape, or no K at all, are refused."""
  a = jnp.array([[-0.5, 2.0], [-2.0, -0.5]])
  x0, k, method = jnp.array([1.0, 0.3]), 3, "rk4"
  ts = solvers.stage_times(k, method)
  field = lambda x, inp: jnp.cos(inp["t"]) * (inp["a"] @ x)
  copied = solvers.fixed_step_solve(
    field, x0, {"t": ts, "a": jnp.broadcast_to(a, ts.shape + a.shape)}, 1.0 / k, method
  )
  shared = {"t": ts, "a": a[None, None]}
  x, traj, outs = solvers.fixed_step_solve(
    lambda x, inp: (field(x, inp), x),
    x0,
    shared,
    1.0 / k,
    method,
    return_trajectory=True,
    eval_outputs=True,
  )
  np.testing.assert_array_equal(np.asarray(x), np.asarray(copied))
  assert outs.shape == (k, solvers.num_evals(method), 2)
  np.testing.assert_array_equal(np.asarray(outs[:, 0]), np.asarray(traj))
  with pytest.raises(ValueError, match=r"leading axes \(3, 1\); expected \[K, 3\]"):
    solvers.fixed_step_solve(field, x0, {"t": ts[:, :1], "a": a[None, None]}, 1.0 / k, method)
  with pytest.raises(ValueError, match="pass num_steps"):
    solvers.fixed_step_solve(lambda x, b: b @ x, x0, a[None, None], 0.5, "euler")
  np.testing.assert_allclose(  # (I + A/2)² x0: two Euler steps of dx/dt = A x
    np.asarray(
      solvers.fixed_step_solve(lambda x, b: b @ x, x0, a[None, None], 0.5, "euler", num_steps=2)
    ),
    np.linalg.matrix_power(np.eye(2) + np.asarray(a) / 2, 2) @ np.asarray(x0),
    rtol=0,
    atol=1e-6,
  )  # float32 state of O(1)


@pytest.mark.slow
def test_model_solver_converges():
  """Each solver reaches its order on a real (smooth in t) transformer field.

  DiffEqFormer's W(t) oscillates at the time embedding's scale (sin(1000·t)), so its
  asymptotic regime needs K ≫ 1000; the weight-sharing field is smooth in t and shows
  the orders at small K (which also needs x0 = √d·embedding, away from LayerNorm's
  stiff region near 0: embed_scale √64 = 8, where the default feeds the embedding as is).
  """
  for method, order in (("euler", 1), ("midpoint", 2), ("rk4", 4)):
    with jax.enable_x64(True):
      model = create_model(
        dataclasses.replace(
          TINY,
          kind="shared",
          d_model=64,
          mlp_dim=128,
          solver=method,
          dtype="float64",
          param_dtype="float64",
          embed_scale=8.0,
        ),
        seed=5,
      )
      toks = tokens(6, b=1, length=8)
      lg = {k: np.asarray(forward(model, toks, num_steps=k)) for k in (8, 16, 256)}
      e8, e16 = (np.abs(lg[k] - lg[256]).max() for k in (8, 16))
    assert np.log2(e8 / e16) > order - 0.5, (method, e8, e16)


@pytest.mark.slow
def test_hypernetwork_gradients_match_finite_differences():
  cfg = dataclasses.replace(
    TINY, dtype="float64", param_dtype="float64", d_model=16, num_heads=2, mlp_dim=32
  )
  with jax.enable_x64(True):
    # The model's structure, its values drawn in numpy (no op-by-op float64 init): every
    # generator non-zero, as _perturb_hypernet's are, norm scales about 1.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=6)))
    rng = np.random.default_rng(6)

    def fill(path, a):
      x = 0.3 * rng.standard_normal(a.shape) / math.sqrt(a.shape[-1])
      name = jax.tree_util.keystr(path)
      return jnp.asarray(x + ("scale" in name and "['proj']" not in name), a.dtype)

    model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))
    toks = tokens(7, b=1, length=6)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest)
      s, w = token_cross_entropy(m(toks, num_steps=3), jnp.roll(toks, -1, axis=1))
      return s / w

    # One compiled program for the gradient and the 12 evaluations below (not op-by-op
    # dispatch, nor a second program for the loss alone): its value is the loss.
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    loss = lambda p: value_and_grad(p)[0]
    grads = jax.tree.map(np.asarray, value_and_grad(params)[1])
    params = jax.tree.map(np.asarray, params)  # host float64: no op-by-op dispatch below
    targets = [
      "/gens/wq/proj",
      "/gens/b1/proj",
      "/gens/norm2_scale/proj",
      "/mlps/q/fc1/kernel",
      "/gens/wo/base",
      "/embed",
    ]
    eps = 1e-6
    for i, target in enumerate(targets):
      # Directional derivative along a random direction supported on one parameter.
      rng = np.random.default_rng(i)

      def direction(path, x, target=target, rng=rng):
        name = "/" + "/".join(str(k.key) for k in path if hasattr(k, "key"))
        hit = name.endswith(target)
        return rng.standard_normal(x.shape) if hit else np.zeros_like(x)

      v = jax.tree_util.tree_map_with_path(direction, params)
      assert sum(float(np.abs(x).sum()) for x in jax.tree.leaves(v)) > 0, target
      plus = jax.tree.map(lambda p, d: p + eps * d, params, v)
      minus = jax.tree.map(lambda p, d: p - eps * d, params, v)
      fd = (float(loss(plus)) - float(loss(minus))) / (2 * eps)
      got = sum(float(np.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(v)))
      assert abs(fd) > 1e-8, target
      assert abs(fd - got) <= 1e-7 + 1e-6 * abs(fd), (target, fd, got)


def _train_step_text(k):
  cfg = dataclasses.replace(TINY, solver_steps=k, num_layers=k, remat_policy="full")
  # Only the program's text is needed: the model's structure, no values.
  model = nnx.eval_shape(lambda: create_model(cfg, seed=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  toks = tokens()

  def loss(p):
    s, w = token_cross_entropy(nnx.merge(graphdef, p, rest)(toks), toks)
    return s / w

  return jax.jit(jax.value_and_grad(loss)).lower(params).as_text()


def test_program_size_flat_in_k():
  small, large = len(_train_step_text(4)), len(_train_step_text(32))
  assert abs(large - small) / small < 0.05, (small, large)


@pytest.fixture(scope="module")
def fresh_wide_model():
  """A fresh (unperturbed) DiffEqFormer, built once for the K cases and the final-state
  test (none modifies it)."""
  cfg = dataclasses.replace(
    TINY, vocab_size=512, d_model=64, mlp_dim=256, time_embed_dim=16, time_sinusoids=16
  )
  return create_model(cfg, seed=8)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 16, 128])
def test_init_well_scaled_at_any_k(k, fresh_wide_model):
  """A fresh DiffEqFormer's field is near zero (W(t) = P·h(t) with P and h both O(σ)), so
  the solve carries the embeddings through almost unchanged at any K, and the initial
  loss is ≈ ln(vocab)."""
  toks = tokens(9, b=4, length=32, vocab=512)
  logits, traj = forward(fresh_wide_model, toks, num_steps=k, return_trajectory=True)
  x0 = np.asarray(traj[0])
  drift = np.abs(np.asarray(traj) - x0).max() / np.abs(x0).max()
  assert np.isfinite(np.asarray(traj)).all() and drift < 1e-2, drift
  targets = jax.random.randint(jax.random.key(10), toks.shape, 0, 512)
  s, w = token_cross_entropy(logits, targets)
  assert abs(float(s / w) - math.log(512)) < 0.1


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_init_follows_the_reference_code(family):
  """P ~ N(0, hyper_init_std²) for weights and N(0, hyper_bias_init_std²) for biases,
  P0 = 0 (1 for norm scales), norm generators 0, time-MLP kernels N(0, σ²) with hidden
  width d_t and zero biases; input embeddings unscaled."""
  cfg = dataclasses.replace(
    TINY,
    family=family,
    d_model=64,
    mlp_dim=256,
    time_embed_dim=16,
    time_hidden=0,
    hyper_init_std=0.03,
    hyper_bias_init_std=1e-3,
  )
  model = create_model(cfg, seed=3)
  for name, gen in model.stack.gens.items():
    role = model.stack.specs[name].role
    proj, base = np.asarray(gen.proj[...]), np.asarray(gen.base[...])
    np.testing.assert_array_equal(base, 1.0 if role == "norm_scale" else 0.0)
    if role.startswith("norm"):
      np.testing.assert_array_equal(proj, 0.0)
    else:
      want = 0.03 if role in ("in", "out") else 1e-3
      assert abs(proj.std() / want - 1) < 0.1 and abs(proj.mean()) < 0.1 * want, (name, proj.std())
  for mlp in model.stack.mlps.values():
    assert mlp.fc1.kernel[...].shape == (2 * cfg.time_sinusoids + 1, cfg.time_embed_dim)
    for layer in (mlp.fc1, mlp.fc2):
      assert abs(float(jnp.std(layer.kernel[...])) / 0.03 - 1) < 0.15
      np.testing.assert_array_equal(np.asarray(layer.bias[...]), 0.0)
  toks = tokens(4, b=1, length=8)
  x = model.embed_tokens(toks, jnp.arange(8)[None])
  want = jnp.take(model.embed[...], toks, axis=0)
  if family == "gpt2":
    want = want + model.pos_embed[...][:8][None]
  np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("kind", ["diffeqformer", "transformer"])
def test_embedding_init_follows_the_reference_models(kind):
  """As the authors' models (levanter's Gpt2Embeddings and LlamaEmbedding): GPT-2 token
  embeddings N(0, 0.02²) and positions N(0, 0.01²); untied Llama token embeddings
  N(0, 1); tied ones are also the head and keep 0.02."""

  def std(**kw):
    m = create_model(dataclasses.replace(TINY, kind=kind, **kw), seed=1)
    return {n: float(jnp.std(getattr(m, n)[...])) for n in ("embed", "pos_embed") if hasattr(m, n)}

  for got, want in (
    (std(family="gpt2"), {"embed": 0.02, "pos_embed": 0.01}),
    (std(family="llama", tie_embeddings=False), {"embed": 1.0}),
    (std(family="llama"), {"embed": 0.02}),
  ):
    assert got.keys() == want.keys()
    for name in want:
      assert abs(got[name] / want[name] - 1) < 0.1, (name, got, want)


@pytest.mark.slow
def test_init_final_state_scale_independent_of_k(fresh_wide_model):
  """The fresh model and the K of test_init_well_scaled_at_any_k: its compiled forward
  passes serve this test too."""
  toks = tokens(12, b=4, length=32, vocab=512)
  finals = []
  for k in (2, 16, 128):
    _, traj = forward(fresh_wide_model, toks, num_steps=k, return_trajectory=True)
    x_last = traj[-1]  # state entering the last step ≈ x(1 - dt)
    finals.append(float(jnp.sqrt(jnp.mean(x_last**2))))
  assert max(finals) / min(finals) < 1.5, finals


@pytest.mark.slow
@pytest.mark.parametrize("kind,family", KINDS)
def test_kinds_train(kind, family):
  model = create_model(
    dataclasses.replace(TINY, kind=kind, family=family, remat_policy="full"), seed=12
  )
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  toks = tokens(13, b=4, length=16)

  @nnx.jit
  def step(model, opt):
    def loss_fn(m):
      s, w = token_cross_entropy(m(toks[:, :-1]), toks[:, 1:])
      return s / w

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(8)]
  assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_remat_policies_same_gradients():
  toks = tokens(14)
  grads = []
  for policy in ("none", "full", "dots_saveable"):
    model = create_model(dataclasses.replace(TINY, remat_policy=policy), seed=15)

    def loss_fn(m):
      s, w = token_cross_entropy(m(toks), toks)
      return s / w

    grads.append(jax.tree.leaves(nnx.jit(nnx.grad(loss_fn))(model)))  # as training runs it
  for g in grads[1:]:
    for a, b in zip(grads[0], g):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["diffeqformer", "transformer"])
def test_unrolled_layer_loop_equals_the_scan(kind):
  """model.layer_loop='unrolled' (GPUs' default) runs the same steps as the scan: the
  same loss and gradients, and no loop left in the program."""
  toks = tokens(17)
  out = {}
  for loop in ("scan", "unrolled"):
    model = create_model(dataclasses.replace(TINY, kind=kind, layer_loop=loop), seed=18)

    def loss_fn(m):
      s, w = token_cross_entropy(m(toks), toks)
      return s / w

    step = nnx.jit(nnx.value_and_grad(loss_fn))
    out[loop] = step(model)
    graphdef, state = nnx.split(model)
    text = jax.jit(lambda st, g=graphdef: loss_fn(nnx.merge(g, st))).lower(state).as_text()
    assert ("stablehlo.while" in text) == (loop == "scan"), loop
  (l_scan, g_scan), (l_unrolled, g_unrolled) = out["scan"], out["unrolled"]
  np.testing.assert_allclose(float(l_unrolled), float(l_scan), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_unrolled), jax.tree.leaves(g_scan)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_auto_layer_loop_unrolls_on_gpus_only():
  k = solvers.MAX_AUTO_UNROLL
  assert solvers.loop_unroll("auto", 12, "cuda") == 12
  assert solvers.loop_unroll("auto", k, "rocm") == k
  assert solvers.loop_unroll("auto", k + 1, "cuda") == 1  # any-N at many steps: a scan
  assert solvers.loop_unroll("auto", 12, "tpu") == solvers.loop_unroll("auto", 12, "cpu") == 1
  assert solvers.loop_unroll("scan", 12, "cuda") == 1
  assert solvers.loop_unroll("unrolled", 12, "cpu") == 12


def test_dropout_and_bf16():
  cfg = dataclasses.replace(TINY, dropout_rate=0.1, dtype="bfloat16")
  model = create_model(cfg, seed=16)
  toks = tokens(17)
  a = forward(model, toks, deterministic=False, dropout_rng=jax.random.key(0))
  b = forward(model, toks, deterministic=False, dropout_rng=jax.random.key(1))
  c = forward(model, toks)
  assert a.dtype == jnp.bfloat16 and np.isfinite(np.asarray(a, np.float32)).all()
  assert not np.array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(c), np.asarray(forward(model, toks)))


@pytest.mark.parametrize("solver, k, masks_per_step", [("rk4", 2, 4 * 2), ("split_euler", 3, 2)])
def test_every_field_evaluation_draws_its_own_dropout_masks(monkeypatch, solver, k, masks_per_step):
  """rk4 evaluates the field 4 times per step (the 2nd and 3rd at the same time), each
  evaluation drawing two dropout masks (attention, FFN); split_euler's two evaluations a
  step (attention part, MLP part) draw one each. Every mask comes from a key of its own,
  as do the embeddings'. Keys are recorded as the model runs."""
  seen, dropout = [], blocks._dropout

  def recording(x, rate, key):
    jax.debug.callback(
      lambda k: seen.append(tuple(np.asarray(k).ravel())), jax.random.key_data(key)
    )
    return dropout(x, rate, key)

  monkeypatch.setattr(blocks, "_dropout", recording)
  model = create_model(dataclasses.replace(TINY, solver=solver, dropout_rate=0.1), seed=16)
  # One program, traced here after the patch (a fresh function: no trace cached without it).
  run = nnx.jit(lambda m, t, r: m(t, num_steps=k, deterministic=False, dropout_rng=r))
  jax.block_until_ready(run(model, tokens(17), jax.random.key(0)))
  assert len(seen) == 1 + k * masks_per_step
  assert len(set(seen)) == len(seen)


def test_float32_state_keeps_small_increments_in_bfloat16():
  """bfloat16 compute at N = 256 steps: the increment dt·F of a step is ~2⁻⁸ of |x|,
  which a bfloat16 state rounds away; the float32 state (model.state_dtype default) is
  much closer to the float32 model."""
  model = create_model(TINY, seed=2)
  _perturb_hypernet(model)
  toks, n = tokens(3), 256

  def logits(**kw):  # `model`'s values (all of its state) in the structure of config kw
    m = nnx.eval_shape(lambda: create_model(dataclasses.replace(TINY, **kw), seed=2))
    nnx.update(m, nnx.state(model))
    graphdef, state = nnx.split(m)
    fn = jax.jit(lambda st: nnx.merge(graphdef, st)(toks, num_steps=n))
    return np.asarray(fn(state), np.float32)

  ref = logits()
  err = {
    sd: np.abs(logits(dtype="bfloat16", state_dtype=sd) - ref).max()
    for sd in ("float32", "bfloat16")
  }
  assert err["float32"] < err["bfloat16"] / 4, err


def test_shared_time_mlp_has_fewer_params():
  def n_params(m):
    return sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))

  per_weight = create_model(TINY, seed=0)
  shared = create_model(dataclasses.replace(TINY, shared_time_mlp=True), seed=0)
  assert n_params(shared) < n_params(per_weight)


@pytest.mark.parametrize(
  "override,message",
  [
    ({"num_heads": 5}, "does not divide"),
    ({"kind": "rnn"}, "model.kind='rnn' is unknown"),
    ({"solver": "dopri"}, "model.solver='dopri' is unknown"),
    ({"solver_steps": 0}, "must be a positive integer"),
    ({"typo_key": 1}, "unknown model config keys"),
    ({"step_time": "middle"}, "model.step_time='middle' is unknown"),
    ({"llama_block": "reference"}, "use llama_block='paper'"),  # family gpt
    (
      {"llama_block": "reference", "family": "llama", "kind": "transformer"},
      "use llama_block='paper'",
    ),
    (
      {"llama_block": "reference", "family": "llama", "solver": "split_euler"},
      "steps attention and FFN apart: use llama_block='paper'",
    ),
  ],
)
def test_config_errors(override, message):
  c = default_model_config()
  with c.unlocked():
    c.update(override)
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_config(c)


def test_sequence_longer_than_positions_is_an_error():
  model = create_model(TINY, seed=0)
  with pytest.raises(ValueError, match="exceeds model.max_len"):
    model(tokens(length=TINY.max_len + 1))


def test_discrete_model_rejects_other_depth():
  model = create_model(dataclasses.replace(TINY, kind="transformer"), seed=0)
  with pytest.raises(ValueError, match="materialize"):
    model(tokens(), num_steps=TINY.depth + 1)


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("k", [1, 6, 12])
def test_generate_weights_and_gradients_match_a_loop_in_float64(k):
  """W[k] = P·h_k + P0 for every k (one einsum over the unreshaped P [*shape, d_t]);
  its VJP is the closed form dP = Σ_k dW_k ⊗ h_k, dh_k = Σ dW_k·P, dP0 = Σ_k dW_k,
  computed here entry by entry in float64."""
  shape, d_t = (5, 3, 4), 7
  rng = np.random.default_rng(k)
  h = rng.normal(size=(k, d_t))
  p = rng.normal(size=shape + (d_t,))
  base = rng.normal(size=shape)
  g = rng.normal(size=(k,) + shape)
  axes = ("embed", "heads", "kv")
  f = lambda a, b, c: generate_weights(a, b, c, axes, jnp.float32)
  w, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (h, p, base)))
  want = np.stack([np.tensordot(p, h[i], axes=([3], [0])) + base for i in range(k)])
  assert w.shape == (k,) + shape and w.dtype == jnp.float32
  np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-5)
  d_h, d_p, d_base = vjp(jnp.asarray(g, jnp.float32))
  want_p = np.zeros_like(p)
  for i in range(k):
    want_p += g[i][..., None] * h[i]
  want_h = np.stack([[np.sum(g[i] * p[..., d]) for d in range(d_t)] for i in range(k)])
  np.testing.assert_allclose(d_p, want_p, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(d_h, want_h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(d_base, g.sum(0), rtol=1e-5, atol=1e-5)


def test_param_count_matches_allocated_model_and_gpt2():
  for cfg in (
    TINY,
    dataclasses.replace(TINY, kind="transformer"),
    dataclasses.replace(TINY, family="llama", shared_time_mlp=True),
  ):
    allocated = sum(x.size for x in jax.tree.leaves(nnx.state(create_model(cfg), nnx.Param)))
    assert count_params(cfg) == allocated
  # GPT-2 closed form: tokens + positions + L·(attention 4d²+4d, MLP 8d²+5d, 2 norms 4d)
  # + final norm 2d.
  v, t, d, layers = 50304, 1024, 768, 12
  closed = v * d + t * d + layers * (12 * d * d + 13 * d) + 2 * d
  assert count_params(paper_config("gpt-small", kind="transformer")) == closed


@pytest.mark.slow
def test_lora_starts_at_base_trains_adapters_only_and_merges():
  base = materialize(create_model(TINY, seed=20), 5)
  cfg = dataclasses.replace(
    base.config, lora_rank=2, lora_alpha=4.0, lora_targets=("wq", "wo", "w2")
  )
  lora = create_model(cfg, seed=21)
  # Copy the base weights into the frozen slots.
  nnx.update(lora, jax.tree.map(lambda x: x, nnx.state(base)))
  toks = tokens(22)
  np.testing.assert_array_equal(np.asarray(lora(toks)), np.asarray(base(toks)))
  trainable = nnx.state(lora, nnx.Param)
  assert all(
    isinstance(v, LoraParam)
    for v in jax.tree.leaves(trainable, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )
  assert isinstance(lora.stack.params["wq"], Frozen) and isinstance(lora.embed, Frozen)
  before = jax.tree.map(np.asarray, nnx.state(lora, Frozen))
  opt = nnx.Optimizer(lora, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit  # one compiled step for the 3 updates below, not op-by-op dispatch
  def train_step(lora, opt):
    grads = nnx.grad(lambda m: token_cross_entropy(m(toks[:, :-1]), toks[:, 1:])[0])(lora)
    opt.update(lora, grads)

  for _ in range(3):
    train_step(lora, opt)
  after = nnx.state(lora, Frozen)
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after))
  assert not np.array_equal(np.asarray(lora(toks)), np.asarray(base(toks)))
  merged = merge_lora(lora)
  assert merged.config.lora_rank == 0
  np.testing.assert_allclose(np.asarray(merged(toks)), np.asarray(lora(toks)), atol=1e-5, rtol=1e-5)
