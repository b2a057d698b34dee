"""Hypernetworks: every layer weight of DiffEqFormer as a function of t.

For each group of layer params (a linear layer's weight and bias, or a norm's scale and
shift) one MLP maps the time embedding to a code, h(t) = MLP(e(t)) ∈ R^{d_t}
(Linear(2S+1→H), SiLU, Linear(H→d_t)); each param is then W(t) = P·h(t) + P0, with
P stored as [*weight_shape, d_t] — every weight entry has its own d_t coefficients,
W[i, o](t) = P[i, o, :]·h(t) + P0[i, o] — so it carries (and shards along) the weight's
own logical axes. Generating all K (times stages) weights is one GEMM per param,
P[in·out, d_t] @ h[K, d_t]ᵀ, done once per forward pass before the solver's scan.

Why d_t is the minor axis: AdamW's moment updates over P compute P's gradient
dP = Σ_k dW_k ⊗ h_k inside their own loops (`generate_weights`), and with d_t minor the
inner loop multiplies one scalar of dW by the d_t-vector h_k, which stays in registers;
with d_t major the inner loop streams K rows of dW again for each of the d_t rows of P.
On a 2-core CPU at bench-small, per 64 MB weight generator: AdamW 17–20 → 13 ms, the
code gradient dW @ P 7.5 → 3.9 ms, the generating GEMM 5.3 → 4.8 ms (jax 0.10; the
whole train step takes a median 0.92 of its d_t-major time, paired over 25 rounds).
On TPU a minor axis is tiled to 128 lanes, so d_t = 128 (or a multiple) keeps P, μ
and ν unpadded there.

Initialisation (why a fresh model is well scaled at any K):
- Each generated matrix W(t) has, at every t, the variance of a fan-in ("LeCun")
  initialised matrix, σ² = 1/fan_in, split evenly between the static part P0 and the
  time-varying part P·h(t). P is drawn N(0, 1/d_t) and rescaled by σ/√2 / rms(h), with
  rms(h) measured on a grid of t at construction, so P·h(t) has RMS σ/√2 whatever the
  MLP's output scale. With LayerNorm'd inputs this makes F(x, t) = Attn + FFN O(1).
- No depth scaling: the solver already multiplies each update by dt = 1/K, so the
  state after the solve is x0 + (1/K)·Σ_k F(x_k, t_k) — an average of O(1) terms —
  and the residual stream's variance stays O(1) for any K (GPT-2 instead scales its
  output projections by 1/√(2L) because its L updates are summed, not averaged).
- Biases, and norms' Γ/Β (scale = 1 + Γ·h(t), shift = Β·h(t)), start at zero: a fresh
  model's norms are plain LayerNorm/RMSNorm.
- Embeddings are N(0, 0.02²) and tied to the head, so logits after the final norm have
  std 0.02·√d (small) and the initial loss is ≈ ln(vocab). ODE models feed the solver
  x0 = √d·embedding (as Gemma does), std 0.02·√d: without it x0 ≈ 0.02 sits in
  LayerNorm's stiff region (Jacobian ~ 1/|x|) and the solve depends strongly on K.
"""
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from odetransformer.blocks import ParamSpec, layer_param_specs
from odetransformer.config import ModelConfig
from odetransformer.time_embedding import time_embedding

_RMS_GRID = 64  # points in [0, 1] on which rms(h) is measured at initialisation


class TimeMLP(nnx.Module):
  """h(t) = Linear(H→d_t)(SiLU(Linear(2S+1→H)(e(t))))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.num_sinusoids = cfg.time_sinusoids
    dtype = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.lecun_normal()
    self.fc1 = nnx.Linear(2 * cfg.time_sinusoids + 1, cfg.hyper_hidden, param_dtype=dtype,
                          kernel_init=nnx.with_partitioning(init, (None, None)),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros, (None,)),
                          rngs=rngs)
    self.fc2 = nnx.Linear(cfg.hyper_hidden, cfg.time_embed_dim, param_dtype=dtype,
                          kernel_init=nnx.with_partitioning(init, (None, "time_embed")),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros,
                                                          ("time_embed",)),
                          rngs=rngs)

  def __call__(self, t):
    """[...] times -> [..., d_t] codes (float32)."""
    return self.fc2(nnx.silu(self.fc1(time_embedding(t, self.num_sinusoids))))

  def rms(self):
    """RMS of h over a uniform grid of t in [0, 1] (used to scale P at init)."""
    h = self(jnp.linspace(0.0, 1.0, _RMS_GRID))
    return jnp.sqrt(jnp.mean(jnp.square(h)) + 1e-12)


# Solver grids up to this many times (K·stages) write P's gradient as a sum of outer
# products rather than a GEMM (see `generate_weights`); larger grids use the GEMM. The
# sum is unrolled, so the bound keeps the program's size flat in K, and the fused form
# stops paying not far above it (AdamW on a 64 MB group, standalone: 12–14 vs 24–25 ms
# for the GEMM at 6–8 times, 18–24 vs 26–30 ms at 12, 165–177 vs 27–32 ms at 16).
OUTER_SUM_MAX_TIMES = 8


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def generate_weights(h_kd, proj_nd, base_n, norm_probe, acc_dtype):
  """(P[N, d_t] @ h[K, d_t]ᵀ)ᵀ + P0[N] -> [K, N] (in `acc_dtype`): all K steps' weights.

  `norm_probe` is a float32 scalar the forward pass ignores; its gradient is ‖dP‖²,
  the squared norm of P's gradient ("ghost norm", as DP-SGD's ghost clipping takes
  per-example norms without forming the gradients). The train step feeds a zero
  probe through every generator and so gets the hypernetworks' share of the global
  gradient norm without any reduction reading dP (see `train._global_norm`).

  Same math as `h @ Pᵀ + P0`, with a backward written for XLA:CPU (on GPU every form
  is the same cuBLAS call), each measured at 54 M hypernetwork weights (jax 0.10):
  - the code gradient dW[K, N] @ P[N, d_t] streams P once (3.9 ms per 64 MB; with P
    stored d_t-major the same product needed an optimization barrier to run at 7.5 ms);
  - P0's gradient Σ_k dW_k as a dot with ones rather than a reduction over the leading
    axis, which XLA:CPU ran ~30× slower (6.8 ms vs 0.2 ms for a [6, 256, 1024] slab);
  - dP = Σ_k dW_k ⊗ h_k, for up to `OUTER_SUM_MAX_TIMES` times, as elementwise products
    XLA fuses into AdamW's two moment updates: dP is never written out or read back
    (a GEMM's output is always written). Its norm then comes from K×K Gram matrices,
    ‖dWᵀh‖² = Σ (hhᵀ) ∘ (dW dWᵀ), since any reduction over dP would write it out.
  """
  del norm_probe
  w = jnp.dot(proj_nd, h_kd.T, preferred_element_type=acc_dtype).T
  return w + base_n.astype(acc_dtype)


@jax.jit
def _outer_sum(g_kn, h_kd):
  """Σ_k g_k ⊗ h_k ([N, d_t]) as K slices of one broadcast product, added in an unrolled
  sum: the form XLA fuses into consumers (a reduce over k, or a GEMM, is written out).
  Jitted, so the program holds one copy per shape rather than one per generator, and
  it is three ops per k: the program stays within a few percent of its size at large K."""
  prod = g_kn[:, :, None] * h_kd[:, None, :]
  return functools.reduce(jnp.add, [prod[k] for k in range(h_kd.shape[0])])


def _generate_fwd(h_kd, proj_nd, base_n, norm_probe, acc_dtype):
  return (generate_weights(h_kd, proj_nd, base_n, norm_probe, acc_dtype),
          (h_kd, proj_nd, base_n, norm_probe))


def _generate_bwd(acc_dtype, residuals, g_kn):
  h_kd, proj_nd, base_n, norm_probe = residuals
  g = g_kn.astype(proj_nd.dtype)
  d_h = jnp.dot(g, proj_nd, preferred_element_type=acc_dtype).astype(h_kd.dtype)
  if h_kd.shape[0] <= OUTER_SUM_MAX_TIMES:
    d_proj = _outer_sum(g.astype(acc_dtype), h_kd.astype(acc_dtype))
  else:
    d_proj = jnp.dot(g.T, h_kd, preferred_element_type=acc_dtype)
  ones = jnp.ones((g_kn.shape[0],), g_kn.dtype)
  d_base = jnp.dot(ones, g_kn, preferred_element_type=acc_dtype).astype(base_n.dtype)
  gram_h = jnp.dot(h_kd, h_kd.T, preferred_element_type=jnp.float32)
  gram_g = jnp.dot(g, g.T, preferred_element_type=jnp.float32)
  # ≥ 0 in exact arithmetic; rounding in the K×K sum must not make the norm's sqrt NaN.
  d_probe = jnp.maximum(jnp.sum(gram_h * gram_g), 0.0).astype(norm_probe.dtype)
  return d_h, d_proj.astype(proj_nd.dtype), d_base, d_probe


generate_weights.defvjp(_generate_fwd, _generate_bwd)


def is_projection(path) -> bool:
  """Whether the parameter at key path `path` is a generator's P (whose squared
  gradient norm the generators' `norm_probe` reports)."""
  parts = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
  if parts and parts[-1] == "value":   # an nnx.Variable's own leaf
    parts = parts[:-1]
  return len(parts) >= 3 and parts[-1] == "proj" and parts[-3] == "gens"


class WeightGenerator(nnx.Module):
  """W(t) = P·h(t) + P0 for one layer param; P is [*shape, d_t]."""

  def __init__(self, spec: ParamSpec, cfg: ModelConfig, h_rms, *, rngs: nnx.Rngs):
    d_t, dtype = cfg.time_embed_dim, jnp.dtype(cfg.param_dtype)
    shape = spec.shape + (d_t,)
    if spec.role in ("in", "out"):
      sigma = 1.0 / math.sqrt(spec.fan_in)
      # Drawn d_t-major and moved: the same values P had when it was stored [d_t, *shape].
      proj = jnp.moveaxis(jax.random.normal(rngs.params(), (d_t,) + spec.shape, dtype), 0, -1)
      proj = proj * (sigma / math.sqrt(2.0) / (math.sqrt(d_t) * h_rms))
      base = jax.random.normal(rngs.params(), spec.shape, dtype) * (sigma / math.sqrt(2.0))
    else:  # biases, norm Γ/Β: zero-initialised; a norm's scale is 1 + Γ·h(t)
      proj = jnp.zeros(shape, dtype)
      base = (jnp.ones if spec.role == "norm_scale" else jnp.zeros)(spec.shape, dtype)
    self.proj = nnx.Param(proj.astype(dtype), out_sharding=spec.axes + ("time_embed",))
    self.base = nnx.Param(base.astype(dtype), out_sharding=spec.axes)

  def __call__(self, h_kd, dtype, norm_probe=None):
    """[K, d_t] codes -> [K, *shape] weights: one GEMM, f32 accumulation. The gradient
    of `norm_probe` (a float32 scalar) is ‖∂L/∂P‖²; see `generate_weights`."""
    proj = self.proj[...]
    d_t = proj.shape[-1]
    if norm_probe is None:
      norm_probe = jnp.zeros((), jnp.float32)
    w = generate_weights(h_kd.astype(dtype), proj.reshape(-1, d_t).astype(dtype),
                         self.base[...].reshape(-1), norm_probe,
                         jnp.promote_types(dtype, jnp.float32))
    return w.reshape((h_kd.shape[0],) + proj.shape[:-1]).astype(dtype)


class HyperNetwork(nnx.Module):
  """All time-dependent layer params of a DiffEqFormer block."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.specs = layer_param_specs(cfg)
    self.groups = tuple(dict.fromkeys(s.group for s in self.specs.values()))
    self.shared = cfg.shared_time_mlp
    if self.shared:
      self.mlp = TimeMLP(cfg, rngs=rngs)
    else:
      self.mlps = nnx.Dict({g: TimeMLP(cfg, rngs=rngs) for g in self.groups})
    gens = {}
    for name, spec in self.specs.items():
      mlp = self.mlp if self.shared else self.mlps[spec.group]
      gens[name] = WeightGenerator(spec, cfg, mlp.rms(), rngs=rngs)
    self.gens = nnx.Dict(gens)

  def codes(self, t):
    """group -> h(t) [..., d_t]."""
    if self.shared:
      h = self.mlp(t)
      return {g: h for g in self.groups}
    return {g: self.mlps[g](t) for g in self.groups}

  def __call__(self, ts, dtype, norm_probe=None):
    """Layer params at times `ts` (any shape [...]): name -> [..., *shape]. The gradient
    of `norm_probe` is Σ‖∂L/∂P‖² over all generators (each P is used once here)."""
    flat = ts.reshape(-1)
    codes = self.codes(flat)
    out = {}
    for name, spec in self.specs.items():
      w = self.gens[name](codes[spec.group], dtype, norm_probe)
      out[name] = w.reshape(ts.shape + w.shape[1:])
    return out
