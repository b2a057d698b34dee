"""Incremental decoding with a fixed-size KV cache, for every model kind.

A `Decoder` turns a trained `LanguageModel` into per-layer weights computed once
(the paper's "precompute the weights per layer" inference) and runs a chunk of new
tokens per call against a cache of keys and values:

| model                         | decoded as                                          |
|-------------------------------|-----------------------------------------------------|
| diffeqformer/shared, Euler    | `materialize(model, N)`: N parallel layers, dt folded |
| diffeqformer/shared,          | `materialize(model, N)`: N sequential (GPT-2 /      |
|   split_euler                 |   Llama) blocks, dt folded                          |
| diffeqformer/shared, midpoint | W(t) at the solver's stage times, precomputed once; |
|   or rk4                      | one cache slot per field evaluation                 |
| gpt                           | its L sequential (GPT-2 / Llama) blocks             |
| parallel                      | its L parallel blocks                               |

The cache is `[slots, b, max_len, heads, head_dim]` (keys and values), where a slot is
one evaluation of a block: a layer of a discrete or materialised model, or one field
evaluation of a higher-order solver step (rk4: 4 per step, each attending over its own
keys). It is written at per-row positions, so rows of a batch may hold prompts of
different lengths (`blocks.LayerCache` says how).

Nothing of the block or the solver is written here: a decode step is the model's own
solve (`solvers.fixed_step_solve`) of its own block (`blocks.block_fn`) given a
`blocks.LayerCache` per field evaluation, so `Decoder.__call__` equals the model's full
forward pass (`model(tokens, num_steps=N)`) at every position (tests/test_generate.py).
"""

import dataclasses
import functools
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.model import blocks, solvers
from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import MATERIALIZED_KIND, materialize
from odetransformer.model.transformer import LanguageModel


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

  cfg: ModelConfig  # config of the model that embeds and projects (materialised if so)
  method: str  # 'euler' | 'midpoint' | 'rk4' (discrete: 'euler' with dt = 1)
  dt: float
  num_layers: int  # solver steps / layers L
  evals: int  # block evaluations per layer (cache slots per layer)


class Decoder:
  """A model prepared for cached decoding at a fixed number of steps.

  Args:
    model: a `LanguageModel` of any kind.
    num_steps: solver steps N for ODE kinds (default: the model's training K);
      discrete kinds accept only their own depth.

  Attributes:
    model: the model that embeds tokens and projects logits (for Euler and
      split-Euler ODEs, the materialised N-layer model; otherwise `model` itself).
    num_steps: N.
    num_slots: cache slots (N × block evaluations per step).
  """

  def __init__(self, model: LanguageModel, num_steps: int | None = None):
    cfg = model.config
    n = model.resolve_num_steps(num_steps)
    self.source_config = cfg
    self.num_steps = n
    if cfg.is_ode and cfg.solver in MATERIALIZED_KIND:  # one layer per step
      model = materialize(model, n)
      cfg = model.config
    # One GEMM per weight for W(t) at the stage times, done once here (a higher-order
    # ODE: dt not folded); [L, 1, …] in the compute dtype for discrete layers.
    layers, dt, method = model.step_weights(n)
    self.model = model
    self.static = _Static(
      cfg=cfg, method=method, dt=float(dt), num_layers=n, evals=solvers.num_evals(method)
    )
    self.num_slots = n * self.static.evals
    # The decode step reads the layer weights from `layers` only; the stack's own
    # params are replaced by shapes when the model is merged inside it.
    graphdef, stack_state, rest = nnx.split(model, nnx.PathContains("stack"), ...)
    abstract_stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stack_state)
    self.params = {"rest": rest, "layers": layers}
    self._fn = functools.partial(_decode_chunk, graphdef, abstract_stack, self.static)
    self._step = jax.jit(self._fn, donate_argnums=(2,))

  @property
  def config(self) -> ModelConfig:
    return self.static.cfg

  def max_positions(self) -> int | None:
    """Longest sequence the model can embed (learned positions), None for RoPE."""
    return self.config.max_len if self.config.family == "gpt2" else None

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    """An empty (zero) cache for `batch_size` rows of up to `max_len` tokens."""
    limit = self.max_positions()
    if limit is not None and max_len > limit:
      raise ValueError(
        f"max_len={max_len} exceeds the model's {limit} learned positions "
        "(model.max_len); shorten the prompt or the generation"
      )
    cfg = self.config
    shape = (self.num_slots, batch_size, max_len, cfg.num_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    # Two buffers (not one array twice): the step donates both.
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def __call__(self, tokens_bl, cache: KVCache, index_b):
    """Runs l new tokens per row at cache positions index_b … index_b + l - 1.

    Args:
      tokens_bl: int tokens [b, l].
      cache: the cache (donated: do not reuse the argument).
      index_b: int [b], each row's first position (= tokens already in the cache).
    Returns:
      (logits [b, l, vocab] in the compute dtype, updated cache).
    """
    b, length = np.shape(tokens_bl)
    index_b = np.broadcast_to(np.asarray(index_b, np.int32), (b,))  # a few ints to host
    if index_b.min() < 0 or index_b.max() + length > cache.max_len:
      raise ValueError(
        f"writing {length} tokens at cache positions {index_b.min()}…"
        f"{index_b.max() + length - 1} overflows the cache of max_len="
        f"{cache.max_len}; make the cache longer (init_cache)"
      )
    return self._step(self.params, jnp.asarray(tokens_bl, jnp.int32), cache, jnp.asarray(index_b))

  def step_fn(self):
    """The pure (params, tokens_bl, cache, index_b) -> (logits, cache) step, for use
    inside other jitted code (e.g. a sampling loop); `self.params` is its first argument.
    Unchecked: the caller keeps index_b + l <= the cache's max_len (a write beyond it
    would be clamped by `dynamic_update_slice`), as `generate.Sampler` does by sizing
    the cache to prompt + new tokens."""
    return self._fn


# --------------------------------------------------------------------------------------
# The step (a pure function)
# --------------------------------------------------------------------------------------
def _decode_chunk(
  graphdef, abstract_stack, static: _Static, params, tokens_bl, cache: KVCache, index_b
):
  """(params, tokens [b, l], cache, index [b]) -> (logits [b, l, vocab], cache): the
  model's solve with one cache slot per field evaluation."""
  model = nnx.merge(graphdef, abstract_stack, params["rest"])
  cfg = static.cfg
  block = blocks.block_fn(cfg)
  length = tokens_bl.shape[1]
  positions_bl = index_b[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
  x = model.embed_tokens(tokens_bl, positions_bl)
  lead = (static.num_layers, static.evals)
  slots = (cache.k.reshape(lead + cache.k.shape[1:]), cache.v.reshape(lead + cache.v.shape[1:]))

  def field(x_bld, p, slot):  # the block in the compute dtype, x in the state's
    out, layer_cache = block(
      x_bld.astype(cfg.dtype), p, cfg, None, positions_bl, cache=blocks.LayerCache(*slot, index_b)
    )
    return out.astype(x_bld.dtype), (layer_cache.k_bsnh, layer_cache.v_bsnh)

  x, (k_cache, v_cache) = solvers.fixed_step_solve(
    field,
    x,
    params["layers"],
    static.dt,
    static.method,
    eval_inputs=slots,
    num_steps=static.num_layers,
    eval_outputs=True,
  )
  new_cache = KVCache(k=k_cache.reshape(cache.k.shape), v=v_cache.reshape(cache.v.shape))
  return model.logits(x), new_cache
