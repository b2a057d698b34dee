"""A pretrained stack of L pre-norm blocks as a DiffEqFormer: its weights W(t) fitted so
that W(t_k) is layer k's, t_k = k/L.

    ode, fit = fit_diffeqformer(model)    # model: a discrete GPT-2/Llama baseline
    ode(tokens)                           # = model(tokens) at N = L, to float32 rounding
    ode(tokens, num_steps=2 * L)          # the same field solved at another N

Why the fit is exact at N = L: a pre-norm block adds attention, then the MLP on the
updated state; one step of the `split_euler` solver (Lie–Trotter splitting of
dx/dt = A(x, t) + F(x, t): an Euler substep of A, then one of F) is that block with its
output projections (W_O, W_2 and their biases) multiplied by dt. So the fitted model is
solved by `split_euler` at K = L, and its W(t_k) holds layer k's weights with those
projections multiplied by L = 1/dt.

The hypernetwork (`hypernet.py`) generates W(t) = P·h(t) + P0, h(t) = MLP(e(t)), for
every layer weight. The fit chooses:

- One time MLP for all weights (`shared_time_mlp`), with e(t) of S = 64 sinusoid pairs and
  hidden width H = 2S + 1. Its first layer is g·I (g = 0.1: e(t) ∈ [-1, 1], so the SiLU
  works near its linear part), its second whitens the codes at the layer times: with
  Z = SiLU(g·e(t_k)) = U Σ Vᵀ (L × H), W_2 = V_L Σ_L⁻¹, so h(t_k) are orthonormal
  (U's rows). Then P = Σ_k (W_k − P0) ⊗ h(t_k) reproduces every layer, and nothing is
  amplified: at S = 64 the L = 30 codes of SmolLM2 have a condition number near 16, while
  S = 16 or 32 gives codes that are not independent at 30 layers (cond > 1e4).
- d_t, the code width: at least L (L independent codes make the fit exact), rounded up
  to a multiple of 8: 32 for L = 30, so P holds d_t/L ≈ 1.07 times the stack's
  parameters. A smaller `time_embed_dim` gives the least-squares fit of rank d_t
  (compression; the per-weight errors say what it costs).
- P0, the mean of the L layers (the part of every weight shared along t), and P the
  minimum-norm solution for the rest, computed in float64 on the codes the model itself
  computes in float32.

Between the layer times W(t) is whatever that basis gives (the codes of e(t) off the
grid); `import.json` holds the fit's errors, and benchmarks/README.md reports what the
model does at other N.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import DT_ROLES
from odetransformer.model.solvers import stage_times
from odetransformer.model.time_embedding import time_embedding
from odetransformer.model.transformer import LanguageModel, abstract_model

SINUSOIDS = 64  # S: e(t) of 2S+1 features; see the module docstring for why 64
GAIN = 0.1  # the time MLP's first layer, g·I


@dataclasses.dataclass(frozen=True)
class Fit:
  """What the fit did.

  Attributes:
    time_embed_dim: d_t, the code width.
    sinusoids: S.
    condition: σ_max/σ_min of the SiLU features at the layer times (how independent the
      L codes are before whitening).
    errors: weight name -> max over layers k of |W(t_k) − W_k| / |W_k| (Frobenius), as
      the fitted model generates W(t_k) in float32.
    parameters: the fitted model's parameter count.
  """

  time_embed_dim: int
  sinusoids: int
  condition: float
  errors: dict
  parameters: int

  def describe(self) -> str:
    worst = max(self.errors, key=self.errors.get)
    return (
      f"d_t={self.time_embed_dim}, S={self.sinusoids} sinusoids (codes' condition "
      f"{self.condition:.1f}); max relative fit error {self.errors[worst]:.1e} ({worst})"
    )


def fit_config(cfg: ModelConfig, time_embed_dim: int | None = None) -> ModelConfig:
  """The DiffEqFormer config a discrete model of config `cfg` is fitted into."""
  if cfg.is_ode:
    raise UserError(f"the fit reads a discrete model's layers; this model is kind={cfg.kind!r}")
  if cfg.block != "sequential":
    raise UserError(
      f"the fit reproduces pre-norm sequential blocks (GPT-2, Llama); this model's block "
      f"is {cfg.block!r}"
    )
  depth = cfg.depth
  d_t = time_embed_dim or max(8, -(-depth // 8) * 8)
  if d_t <= 0:
    raise UserError(f"--fit_time_embed_dim={d_t} must be positive (or 0: at least L)")
  return dataclasses.replace(
    cfg,
    kind="diffeqformer",
    solver="split_euler",
    step_time="start",
    solver_steps=depth,
    num_layers=None,
    time_embed_dim=d_t,
    time_sinusoids=SINUSOIDS,
    time_hidden=2 * SINUSOIDS + 1,
    shared_time_mlp=True,
    train_time_grid="fixed",
  )


def layer_times(num_layers: int) -> np.ndarray:
  """t_k = k/L as the solver computes them (float32): split_euler's one stage, 'start'."""
  return np.asarray(stage_times(num_layers, "split_euler", "start"))[:, 0]


def _time_mlp(cfg: ModelConfig, times: np.ndarray) -> tuple:
  """(fc1 kernel, fc2 kernel, condition): g·I, and the whitening of the codes at `times`."""
  h = 2 * SINUSOIDS + 1
  fc1 = GAIN * np.eye(h, dtype=np.float32)
  e = time_embedding(jnp.asarray(times), SINUSOIDS, cfg.time_scale)
  z = np.asarray(jax.nn.silu(e @ fc1), np.float64)
  _, sigma, vt = np.linalg.svd(z, full_matrices=False)
  rank = min(len(times), cfg.time_embed_dim)
  fc2 = np.zeros((h, cfg.time_embed_dim))
  fc2[:, :rank] = vt[:rank].T / sigma[:rank]
  return fc1, fc2.astype(np.float32), float(sigma[0] / sigma[len(times) - 1])


def fit_diffeqformer(model: LanguageModel, time_embed_dim: int | None = None) -> tuple:
  """(the fitted DiffEqFormer, `Fit`) of a discrete pre-norm model (module docstring)."""
  cfg = fit_config(model.config, time_embed_dim)
  depth = cfg.depth
  times = layer_times(depth)
  fc1, fc2, condition = _time_mlp(cfg, times)
  graphdef, abstract = abstract_model(cfg)
  source = nnx.to_pure_dict(nnx.state(model))
  target = nnx.to_pure_dict(abstract)
  values = {k: v for k, v in source.items() if k != "stack"}  # embeddings, final norm, head
  stack = target["stack"]
  zeros = lambda a: np.zeros(a.shape, a.dtype)  # noqa: E731
  mlp = {
    "fc1": {"kernel": fc1, "bias": zeros(stack["mlp"]["fc1"]["bias"])},
    "fc2": {"kernel": fc2, "bias": zeros(stack["mlp"]["fc2"]["bias"])},
  }
  # The codes h(t_k) as the fitted model computes them (float32), the fit's design matrix.
  probe = nnx.merge(graphdef, _filled(target, {**values, "stack": {"mlp": mlp, "gens": None}}))
  codes = np.asarray(probe.stack.codes(jnp.asarray(times))[next(iter(probe.stack.groups))])
  solve = np.linalg.pinv(codes.astype(np.float64))  # [d_t, L]: min-norm least squares
  layers = {n: np.asarray(w, np.float64) for n, w in model.layer_weights(jnp.float32).items()}
  specs = probe.stack.specs
  targets, gens = {}, {}
  for name, w in layers.items():
    if specs[name].role in DT_ROLES:
      w = w * depth  # dt = 1/L moves out of the weight into the solver's step
    base = w.mean(axis=0)
    proj = solve @ (w - base).reshape(depth, -1)  # [d_t, size]
    gens[name] = {
      "proj": np.moveaxis(proj.reshape((-1,) + w.shape[1:]), 0, -1).astype(np.float32),
      "base": base.astype(np.float32),
    }
    targets[name] = w
  fitted = nnx.merge(graphdef, _filled(target, {**values, "stack": {"mlp": mlp, "gens": gens}}))
  generated = fitted.stack.step_weights(jnp.asarray(times), jnp.float32)
  errors = {
    n: float(
      max(
        np.linalg.norm(np.asarray(generated[n][k], np.float64) - targets[n][k])
        / max(np.linalg.norm(targets[n][k]), 1e-30)
        for k in range(depth)
      )
    )
    for n in targets
  }
  count = int(sum(x.size for x in jax.tree.leaves(nnx.state(fitted, nnx.Param))))
  return fitted, Fit(cfg.time_embed_dim, SINUSOIDS, condition, errors, count)


def _filled(target, values):
  """`target`'s abstract tree with `values` where given (None: zeros), in its dtypes."""
  if isinstance(target, dict):
    values = values or {}
    return {k: _filled(v, values.get(k)) for k, v in target.items()}
  if values is None:
    return jnp.zeros(target.shape, target.dtype)
  return jnp.asarray(np.asarray(values).reshape(target.shape), target.dtype)


def parallel_field(model: LanguageModel) -> LanguageModel:
  """The fitted model's weights under the parallel Euler field dx/dt = A(x) + F(x) (both
  updates from the same state, the DiffEqFormer of the paper): not the pretrained
  function at any N, reported beside the split solve."""
  cfg = dataclasses.replace(model.config, solver="euler")
  graphdef, state = nnx.split(model)
  out = nnx.merge(graphdef, state)
  out.config = cfg
  return out
