"""Incremental decoding with a fixed-size KV cache, for every model kind.

A `Decoder` turns a trained `LanguageModel` into per-layer weights computed once
(the paper's "precompute the weights per layer" inference) and runs a chunk of new
tokens per call against a cache of keys and values:

| model                         | decoded as                                          |
|-------------------------------|-----------------------------------------------------|
| diffeqformer/shared, Euler    | `materialize(model, N)`: N parallel layers, dt folded |
| diffeqformer/shared, midpoint | W(t) at the solver's stage times, precomputed once; |
|   or rk4                      | one cache slot per field evaluation                 |
| gpt                           | its L sequential (GPT-2 / Llama) blocks             |
| parallel                      | its L parallel blocks                               |

The cache is `[slots, b, max_len, heads, head_dim]` (keys and values), where a slot is
one evaluation of a block: a layer of a discrete or materialised model, or one stage of
a higher-order solver step (rk4: 4 per step, each attending over its own keys). It is
written at per-row positions, so rows of a batch may hold prompts of different lengths:
a row's query at cache position p attends to positions 0…p of that row only. Positions
beyond p may hold stale values (a right-padded prompt's tail); they are never attended
and are overwritten before they become visible.

The block math reuses `blocks.norm`, `blocks.rope` and `blocks.ffn`; only attention is
written here, against the cache. `Decoder.__call__` equals the model's full forward
pass (`model(tokens, num_steps=N)`) at every position (tests/test_generate.py).
"""
import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from odetransformer.model import blocks
from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import materialize
from odetransformer.model.transformer import LanguageModel
from odetransformer.model.solvers import STAGE_NODES, TABLEAUX, rk_step



class KVCache(NamedTuple):
  """Keys and values of every slot: each [slots, b, max_len, heads, head_dim]."""
  k: jax.Array
  v: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the compiled decode step is specialised on (hashable)."""
  cfg: ModelConfig     # config of the model that embeds and projects (materialised if so)
  block: str           # 'parallel' | 'sequential'
  method: str          # 'euler' | 'midpoint' | 'rk4' (discrete: 'euler' with dt = 1)
  dt: float
  num_layers: int      # solver steps / layers L
  evals: int           # block evaluations per layer (cache slots per layer)
  discrete: bool       # layers are [L, ...] (one stage: the step adds the stage axis)


class Decoder:
  """A model prepared for cached decoding at a fixed number of steps.

  Args:
    model: a `LanguageModel` of any kind.
    num_steps: solver steps N for ODE kinds (default: the model's training K);
      discrete kinds accept only their own depth.

  Attributes:
    model: the model that embeds tokens and projects logits (for Euler ODEs, the
      materialised N-layer parallel model; otherwise `model` itself).
    num_steps: N.
    num_slots: cache slots (N × block evaluations per step).
  """

  def __init__(self, model: LanguageModel, num_steps: Optional[int] = None):
    cfg = model.config
    n = model.resolve_num_steps(num_steps)
    self.source_config = cfg
    self.num_steps = n
    if cfg.is_ode and cfg.solver == "euler":
      model = materialize(model, n)
      cfg = model.config
    if cfg.is_ode:  # higher-order solver: W(t) at its stage times, dt not folded
      if cfg.kind == "diffeqformer":
        layers, dt = model.step_params(n)     # one GEMM per weight, done once here
      else:
        stages = len(STAGE_NODES[cfg.solver])
        layers = {k: jnp.broadcast_to(v.astype(cfg.dtype), (n, stages) + v.shape)
                  for k, v in model.stack.layer().items()}
        dt = 1.0 / n
      method = cfg.solver
    else:  # [L, ...] in the compute dtype (the model's own arrays when that is param_dtype)
      layers = {k: v.astype(cfg.dtype) for k, v in model.stack.layers().items()}
      dt, method = 1.0, "euler"
    self.model = model
    self.static = _Static(cfg=cfg, block="sequential" if cfg.kind == "gpt" else "parallel",
                          method=method, dt=float(dt), num_layers=n,
                          evals=len(TABLEAUX[method].stages), discrete=not cfg.is_ode)
    self.num_slots = n * self.static.evals
    # The decode step reads the layer weights from `layers` only; the stack's own
    # params are replaced by shapes when the model is merged inside it.
    graphdef, stack_state, rest = nnx.split(model, nnx.PathContains("stack"), ...)
    abstract_stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                  stack_state)
    self.params = {"rest": rest, "layers": layers}
    self._fn = functools.partial(_decode_chunk, graphdef, abstract_stack, self.static)
    self._step = jax.jit(self._fn, donate_argnums=(2,))

  @property
  def config(self) -> ModelConfig:
    return self.static.cfg

  def max_positions(self) -> Optional[int]:
    """Longest sequence the model can embed (learned positions), None for RoPE."""
    return self.config.max_len if self.config.flavour == "gpt" else None

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    """An empty (zero) cache for `batch_size` rows of up to `max_len` tokens."""
    limit = self.max_positions()
    if limit is not None and max_len > limit:
      raise ValueError(f"max_len={max_len} exceeds the model's {limit} learned positions "
                       "(model.max_len); shorten the prompt or the generation")
    cfg = self.config
    shape = (self.num_slots, batch_size, max_len, cfg.num_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    # Two buffers (not one array twice): the step donates both.
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def __call__(self, tokens_bt, cache: KVCache, index_b):
    """Runs t new tokens per row at cache positions index_b … index_b + t - 1.

    Args:
      tokens_bt: int tokens [b, t].
      cache: the cache (donated: do not reuse the argument).
      index_b: int [b], each row's first position (= tokens already in the cache).
    Returns:
      (logits [b, t, vocab] in the compute dtype, updated cache).
    """
    b, t = np.shape(tokens_bt)
    index_b = np.broadcast_to(np.asarray(index_b, np.int32), (b,))   # a few ints to host
    if index_b.min() < 0 or index_b.max() + t > cache.max_len:
      raise ValueError(f"writing {t} tokens at cache positions {index_b.min()}…"
                       f"{index_b.max() + t - 1} overflows the cache of max_len="
                       f"{cache.max_len}; make the cache longer (init_cache)")
    return self._step(self.params, jnp.asarray(tokens_bt, jnp.int32), cache,
                      jnp.asarray(index_b))

  def step_fn(self):
    """The pure (params, tokens_bt, cache, index_b) -> (logits, cache) step, for use
    inside other jitted code (e.g. a sampling loop); `self.params` is its first argument.
    Unchecked: the caller keeps index_b + t <= the cache's max_len (a write beyond it
    would be clamped by `dynamic_update_slice`), as `generate.Sampler` does by sizing
    the cache to prompt + new tokens."""
    return self._fn


# --------------------------------------------------------------------------------------
# The step (pure functions)
# --------------------------------------------------------------------------------------
def _write(cache_bsnh, new_btnh, index_b):
  """Writes each row's t new entries at its own position (in range: see `step_fn`)."""
  return jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0, 0)))(
      cache_bsnh, new_btnh.astype(cache_bsnh.dtype), index_b)


def cached_attention(x_btd, p, cfg: ModelConfig, k_bsnh, v_bsnh, index_b, positions_bt):
  """Causal self-attention of t new tokens over the cache; returns (out, k, v).

  Same math as `blocks.attention` (and `jax.nn.dot_product_attention`'s XLA path):
  scores in float32 or wider, scaled by 1/√head_dim, softmax in float32.
  """
  q, k, v = blocks.qkv_projections(x_btd, p, cfg, positions_bt)
  k_bsnh = _write(k_bsnh, k, index_b)
  v_bsnh = _write(v_bsnh, v, index_b)
  wide = jnp.promote_types(q.dtype, jnp.float32)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k_bsnh, preferred_element_type=wide)
  scores = scores * jnp.asarray(1.0 / (q.shape[-1] ** 0.5), wide)
  t, s = q.shape[1], k_bsnh.shape[1]
  query_pos = index_b[:, None] + jnp.arange(t)[None, :]               # [b, t]
  allowed = jnp.arange(s)[None, None, :] <= query_pos[:, :, None]      # [b, t, s]
  scores = jnp.where(allowed[:, None], scores, jnp.finfo(wide).min)
  probs = jax.nn.softmax(scores.astype(jnp.promote_types(wide, jnp.float32)), axis=-1)
  o = jnp.einsum("bnts,bsnh->btnh", probs.astype(v_bsnh.dtype), v_bsnh)
  return blocks.output_projection(o, p), k_bsnh, v_bsnh


def _block(x_btd, p, static: _Static, k_bsnh, v_bsnh, index_b, positions_bt):
  """One block's update (the ODE's field, or a discrete layer's residual) and its cache."""
  cfg = static.cfg
  h = blocks.block_norm(x_btd, p, "norm1", cfg)
  a, k_bsnh, v_bsnh = cached_attention(h, p, cfg, k_bsnh, v_bsnh, index_b, positions_bt)
  ffn_in = x_btd + a if static.block == "sequential" else blocks.ffn_input(x_btd, h, cfg)
  m = blocks.ffn(blocks.block_norm(ffn_in, p, "norm2", cfg), p, cfg)
  return a + m, k_bsnh, v_bsnh


def _solver_step(x, w_s, static: _Static, k_e, v_e, index_b, positions_bt):
  """x_k -> x_{k+1} (the solvers' `rk_step`) with one cache slot per field evaluation."""
  new_k, new_v = [], []

  def field(x_in, e):
    stage = TABLEAUX[static.method].stages[e]
    p = jax.tree.map(lambda a: a[stage], w_s)
    out, k, v = _block(x_in.astype(static.cfg.dtype), p, static, k_e[e], v_e[e], index_b,
                       positions_bt)
    new_k.append(k)
    new_v.append(v)
    return out.astype(x_in.dtype)      # the state stays in its dtype (model.state_dtype)

  x = rk_step(field, static.method, x, static.dt)
  return x, jnp.stack(new_k), jnp.stack(new_v)


def _decode_chunk(graphdef, abstract_stack, static: _Static, params, tokens_bt,
                  cache: KVCache, index_b):
  """(params, tokens [b, t], cache, index [b]) -> (logits [b, t, vocab], cache)."""
  model = nnx.merge(graphdef, abstract_stack, params["rest"])
  layers = params["layers"]
  if static.discrete:
    layers = {k: v[:, None] for k, v in layers.items()}
  t = tokens_bt.shape[1]
  positions_bt = index_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  x = model.embed_tokens(tokens_bt, positions_bt)
  lead = (static.num_layers, static.evals)
  k_cache = cache.k.reshape(lead + cache.k.shape[1:])
  v_cache = cache.v.reshape(lead + cache.v.shape[1:])

  def layer(x, xs):
    w_s, k_e, v_e = xs
    x, k_e, v_e = _solver_step(x, w_s, static, k_e, v_e, index_b, positions_bt)
    return x, (k_e, v_e)

  x, (k_cache, v_cache) = jax.lax.scan(layer, x, (layers, k_cache, v_cache))
  new_cache = KVCache(k=k_cache.reshape(cache.k.shape), v=v_cache.reshape(cache.v.shape))
  return model.logits(x), new_cache
