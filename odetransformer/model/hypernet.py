"""Hypernetworks: every layer weight of DiffEqFormer as a function of t.

For each group of layer params (a linear layer's weight and bias, or a norm's scale and
shift) one MLP maps the time embedding to a code, h(t) = MLP(e(t)) ∈ R^{d_t}
(Linear(2S+1→H), SiLU, Linear(H→d_t)); each param is then W(t) = P·h(t) + P0, with
P stored as [*weight_shape, d_t] — every weight entry has its own d_t coefficients,
W[i, o](t) = P[i, o, :]·h(t) + P0[i, o] — so it carries (and shards along) the weight's
own logical axes. Generating all K (times stages) weights is one GEMM per param that
contracts d_t alone, W[k, …] = Σ_d P[…, d]·h[k, d] (`generate_weights`), done once per
forward pass before the solver's scan. Under a mesh P is sharded along the weight's
axes (d_t never is), so every device generates its own shard of W(t_k) for all k and
nothing gathers P: from there W is gathered per step like a GPT's stacked weights.

Why d_t is the minor axis: the contraction then reads each weight entry's d_t
coefficients contiguously, P's gradient Σ_k dW_k ⊗ h_k is written the same way, and the
weight axes lead, as they do in the weight itself. On TPU a minor axis is tiled to 128
lanes, so d_t = 128 (or a multiple) keeps P, μ and ν unpadded there.

Initialisation, as the authors' code (SDML-KU/qkvflow) does it, each value a field of
`ModelConfig`:
- P of every weight generator and the time MLPs' kernels are N(0, σ²), σ =
  `hyper_init_std` (0.02); P0 and the MLPs' biases start at 0. A fresh W(t) = P·h(t) is
  therefore tiny (h(t) itself is O(σ)): every step's update starts near zero and the
  residual stream carries the embeddings through, like a zero-initialised residual
  branch; training grows the field from there.
- P of the bias generators is N(0, `hyper_bias_init_std`²) (1e-4).
- Norms' Γ/Β (scale = 1 + Γ·h(t), shift = Β·h(t)) start at zero: a fresh model's norms
  are plain LayerNorm/RMSNorm.
- No depth scaling: the solver already multiplies each update by dt = 1/K.
With unscaled input embeddings, this init is what brings DiffEqFormer to GPT's quality
at small scale on WikiText-2: `python -m benchmarks.quality --data_dir=DIR`, figures in
benchmarks/README.md ("Quality").
"""

from flax import nnx
import jax
import jax.numpy as jnp

from odetransformer.model.axes import constrain
from odetransformer.model.blocks import ParamSpec, layer_param_specs
from odetransformer.model.config import ModelConfig
from odetransformer.model.time_embedding import time_embedding


class TimeMLP(nnx.Module):
  """h(t) = Linear(H→d_t)(SiLU(Linear(2S+1→H)(e(t))))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.num_sinusoids = cfg.time_sinusoids
    self.time_scale = float(cfg.time_scale)
    dtype = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.normal(stddev=cfg.hyper_init_std)
    self.fc1 = nnx.Linear(
      2 * cfg.time_sinusoids + 1,
      cfg.hyper_hidden,
      param_dtype=dtype,
      kernel_init=nnx.with_partitioning(init, (None, None)),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, (None,)),
      rngs=rngs,
    )
    self.fc2 = nnx.Linear(
      cfg.hyper_hidden,
      cfg.time_embed_dim,
      param_dtype=dtype,
      kernel_init=nnx.with_partitioning(init, (None, "time_embed")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("time_embed",)),
      rngs=rngs,
    )

  def __call__(self, t):
    """[...] times -> [..., d_t] codes (float32)."""
    e = time_embedding(t, self.num_sinusoids, self.time_scale)
    return self.fc2(nnx.silu(self.fc1(e)))


def generate_weights(h_kd, proj, base, axes, acc_dtype, param_rules=None):
  """W[k] = P·h_k + P0 for all K times at once: [K, d_t] codes, P [*shape, d_t] and
  P0 [*shape] -> W [K, *shape] (in `acc_dtype`).

  One batched GEMM that contracts d_t only: every weight axis of P stays where it is, so
  under a mesh each device makes its own shard of W(t_k) for every k from its own
  shard of P (`axes` are the weight's logical axes, and W is constrained to them by
  `param_rules`, the parameters' rules; None: the rules in force). Nothing gathers P; W
  is gathered per solver step by the layer that uses it, exactly as a GPT's stacked
  weights are, and P's gradient is the transposed GEMM on dW, reduced over the batch
  shards as a GPT weight's gradient is.
  Plain autodiff: a hand-written backward would hide the contraction from the SPMD
  partitioner.
  """
  w = jnp.einsum("...d,kd->k...", proj, h_kd, preferred_element_type=acc_dtype)
  w = w + base.astype(acc_dtype)
  return constrain(w, (None,) + tuple(axes), param_rules)


class Projection(nnx.Param):
  """A weight generator's projection P [*weight axes, d_t] (W(t) = P·h(t) + P0): the
  hypernetwork's bulk, which tools select by this type (e.g. `state.filter(Projection)`)."""


class WeightGenerator(nnx.Module):
  """W(t) = P·h(t) + P0 for one layer param; P is [*shape, d_t]."""

  def __init__(self, spec: ParamSpec, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    shape = spec.shape + (cfg.time_embed_dim,)
    std = {
      "in": cfg.hyper_init_std,
      "out": cfg.hyper_init_std,
      "bias": cfg.hyper_bias_init_std,
      "out_bias": cfg.hyper_bias_init_std,
    }.get(spec.role)
    if std is None:  # norm Γ/Β: zero, so a norm's scale is 1 + 0·h(t)
      proj = jnp.zeros(shape, dtype)
    else:
      proj = jax.random.normal(rngs.params(), shape, dtype) * std
    base = (jnp.ones if spec.role == "norm_scale" else jnp.zeros)(spec.shape, dtype)
    self.proj = Projection(proj, out_sharding=spec.axes + ("time_embed",))
    self.base = nnx.Param(base, out_sharding=spec.axes)

  def __call__(self, h_kd, dtype, axes, param_rules=None):
    """[K, d_t] codes -> [K, *shape] weights in `dtype`: one GEMM, f32 accumulation.
    `axes` are the weight's logical axes (its ParamSpec's); `param_rules` as in
    `generate_weights`."""
    # The GEMM in float32 (or wider) on P as stored: casting P to a bfloat16 copy first
    # would write and read that copy (and pad d_t for the tensor cores) every step, for a
    # contraction of d_t alone whose FLOPs do not matter; W(t) is rounded once, at the end.
    wide = jnp.promote_types(dtype, jnp.float32)
    w = generate_weights(
      h_kd.astype(wide), self.proj[...].astype(wide), self.base[...], axes, wide, param_rules
    )
    return w.astype(dtype)


class HyperNetwork(nnx.Module):
  """All time-dependent layer params of a DiffEqFormer block: the layer-weight source
  of 'diffeqformer' (`transformer.weight_source`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.specs = layer_param_specs(cfg)
    self.groups = tuple(dict.fromkeys(s.group for s in self.specs.values()))
    self.shared = cfg.shared_time_mlp
    if self.shared:
      self.mlp = TimeMLP(cfg, rngs=rngs)
    else:
      self.mlps = nnx.Dict({g: TimeMLP(cfg, rngs=rngs) for g in self.groups})
    self.gens = nnx.Dict(
      {name: WeightGenerator(spec, cfg, rngs=rngs) for name, spec in self.specs.items()}
    )

  def codes(self, t):
    """group -> h(t) [..., d_t]."""
    if self.shared:
      h = self.mlp(t)
      return {g: h for g in self.groups}
    return {g: self.mlps[g](t) for g in self.groups}

  def interpolation_error(self, grid, alpha):
    """How far W(t) between the times of `grid` [K+1] is from the straight line between
    its values at the step's ends, at the fractions `alpha` [K] of each step
    (`model.time_interp_weight`): Σ over the groups (params sharing a time MLP) of
    mean_k ‖W(u_k) − ((1−α_k)·W(g_k) + α_k·W(g_(k+1)))‖² / mean_k ‖W(g_(k+1)) − W(g_k)‖²,
    u_k = g_k + α_k·(g_(k+1) − g_k), summed over the group's params. W(t) = P·h(t) + P0,
    so W's residual is P·r for the codes' residual r, and ‖P·r‖² = rᵀ(PᵀP)r: one d_t × d_t
    Gram matrix per group, no weights generated. Measured on W, not on h: a code that
    swings along a direction P ignores would score nothing. The denominator is held fixed
    (no gradient), so the penalty never pays for larger steps between layers. 0 when W is
    linear on every step."""
    grid = jnp.asarray(grid, jnp.float32)
    u = grid[:-1] + alpha * (grid[1:] - grid[:-1])
    codes = self.codes(jnp.concatenate([grid, u]))  # the K+1 ends and the K points
    grams = {}
    for name, spec in self.specs.items():
      proj = self.gens[name].proj[...].astype(jnp.float32)
      p = proj.reshape(-1, proj.shape[-1])
      grams[spec.group] = grams.get(spec.group, 0.0) + p.T @ p
    total = jnp.float32(0.0)
    n = grid.shape[0]
    for group, gram in grams.items():
      ends, mid = codes[group][:n], codes[group][n:]
      r = mid - ((1.0 - alpha)[:, None] * ends[:-1] + alpha[:, None] * ends[1:])
      dh = ends[1:] - ends[:-1]
      off = jnp.mean(jnp.einsum("kd,de,ke->k", r, gram, r))
      change = jnp.mean(jnp.einsum("kd,de,ke->k", dh, gram, dh))
      total = total + off / (jax.lax.stop_gradient(change) + 1e-30)
    return total

  def step_weights(self, ts, dtype, param_rules=None):
    """Layer params W(t) at times `ts` (the solver's [K, S], or any shape [...]):
    name -> [..., *shape] in `dtype`, each sharded as its parameters by `param_rules`
    (the parameters' logical-axis rules; None: the rules in force)."""
    flat = ts.reshape(-1)
    codes = self.codes(flat)
    out = {}
    for name, spec in self.specs.items():
      w = self.gens[name](codes[spec.group], dtype, spec.axes, param_rules)
      out[name] = w.reshape(ts.shape + w.shape[1:])
    return out
