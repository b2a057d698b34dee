"""The language model: embeddings → one solver scan over layer params → norm → head.

Three layer-weight sources (`LanguageModel.stack`, picked by kind in `weight_source`)
answer one question, `stack.step_weights(times [K, S], dtype)`: the layer params at the
solver's stage times. The scan (`solvers.fixed_step_solve`), materialisation, decoding
and the analysis all ask it (through `LanguageModel.step_weights`):

| kind           | step weights                                              | update       |
|----------------|-----------------------------------------------------------|--------------|
| diffeqformer   | W(t) from `HyperNetwork`, [K, S, …], made before the scan | x + dt·F (*) |
| shared         | one layer at every step (Zhong et al.), [1, 1, …]         | x + dt·F (*) |
| gpt / parallel | stacked layers (`DiscreteStack`), [L, 1, …]               | x + block(x) |

(*) Euler's; `model.solver` picks the method. 'split_euler' steps the field's two parts
apart (`blocks.BLOCK_PARTS`): x' = x + dt·Attn(N1(x)), then x' + dt·FFN(N2(x')).

`num_steps` is a call-time argument: an ODE's parameters hold no K.
"""

import math

from flax import nnx
import jax
import jax.numpy as jnp

from odetransformer.model import axes, blocks, lora, solvers
from odetransformer.model.axes import constrain
from odetransformer.model.config import ModelConfig
from odetransformer.model.hypernet import HyperNetwork
from odetransformer.model.time_grid import check_time_grid, uniform_grid

EMBED_STD = 0.02
# As the authors' models (levanter's embeddings): GPT-2's learned positions N(0, 0.01²);
# Llama's token embeddings N(0, 1) when untied (tied, they are also the head: 0.02).
POS_EMBED_STD = 0.01
LLAMA_EMBED_STD = 1.0
# The model's weights outside its layer-weight source.
_TOP_LEVEL = ("embed", "pos_embed", "final_norm_scale", "final_norm_shift", "head")


def state_dtype(cfg: ModelConfig):
  """dtype of the solver state x: `model.state_dtype`, or the compute dtype if wider."""
  return jnp.promote_types(cfg.dtype, cfg.state_dtype)


def _init_layer_param(key, spec: blocks.ParamSpec, std: float, dtype, lead=()):
  shape = tuple(lead) + spec.shape
  if spec.role in ("in", "out"):
    return jax.random.normal(key, shape, dtype) * std
  return (jnp.ones if spec.role == "norm_scale" else jnp.zeros)(shape, dtype)


class DiscreteStack(nnx.Module):
  """L independent layers, stored stacked [L, …] (logical axis 'layers'): a layer-weight
  source (see `LanguageModel.stack`) whose weights ignore t.

  With `cfg.lora_rank > 0` the layers are `lora.Frozen` and each target weight gets
  adapters (`lora.init_adapters`): W = W0 + (alpha/r)·A·B, equal to W0 at
  initialisation.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    self.specs = blocks.layer_param_specs(cfg)
    self.lora_scale = lora.scale(cfg)
    self.out_proj_scale = cfg.out_proj_scale
    var = lora.Frozen if cfg.lora_rank else nnx.Param
    params = {}
    for name, spec in self.specs.items():
      # GPT-2 initialisation: N(0, 0.02²), output projections scaled by 1/√(2L).
      std = EMBED_STD / (math.sqrt(2 * cfg.depth) if spec.role == "out" else 1.0)
      params[name] = var(
        _init_layer_param(rngs.params(), spec, std, dtype, lead=(cfg.depth,)),
        out_sharding=("layers",) + spec.axes,
      )
    self.params = nnx.Dict(params)
    if cfg.lora_rank:
      self.lora = lora.init_adapters(cfg, self.specs, rngs)

  def step_weights(self, times, dtype, param_rules=None):
    """The L layers as L one-stage Euler steps, name -> [L, 1, *shape] in `dtype`
    (`times` is ignored; stored weights keep their own sharding, so `param_rules` too):
    LoRA updates and `out_proj_scale` applied in the param dtype."""
    del times, param_rules
    out = {name: p[...] for name, p in self.params.items()}
    if self.lora_scale:
      out = lora.apply(out, self.lora, self.lora_scale)
    if self.out_proj_scale != 1.0:  # a materialised ODE's dt, over W and its LoRA update
      out = {
        name: (w * self.out_proj_scale if self.specs[name].role in ("out", "out_bias") else w)
        for name, w in out.items()
      }
    return {name: w.astype(dtype)[:, None] for name, w in out.items()}


class SharedLayer(nnx.Module):
  """One layer used at every solver step (the weight-sharing ODE): a layer-weight source
  whose weights are the same at every t."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    self.specs = blocks.layer_param_specs(cfg)
    # Fan-in init with no depth scaling: dt = 1/K already averages the K updates.
    self.params = nnx.Dict(
      {
        name: nnx.Param(
          _init_layer_param(rngs.params(), spec, 1.0 / math.sqrt(spec.fan_in), dtype),
          out_sharding=spec.axes,
        )
        for name, spec in self.specs.items()
      }
    )

  def step_weights(self, times, dtype, param_rules=None):
    """The layer at every time of `times` [K, S]: name -> [1, 1, *shape] in `dtype`, which
    the solver broadcasts over the steps and stages (`solvers.broadcast_stages`); stored
    weights keep their own sharding (`param_rules` unused)."""
    del times, param_rules
    return {name: p[...].astype(dtype)[None, None] for name, p in self.params.items()}


def weight_source(cfg: ModelConfig, rngs: nnx.Rngs):
  """The model's layer-weight source for `cfg.kind`: the one place a kind picks one.

  Every source has `specs` (name -> `blocks.ParamSpec`) and answers
  `step_weights(times [K, S], dtype) -> name -> [K, S, *shape]`, the layer params at the
  solver's stage times: W(t) for the hypernetwork, [1, 1, *shape] (broadcast) for the
  shared layer, [L, 1, *shape] for a discrete stack, which ignores the times.
  """
  if cfg.kind == "diffeqformer":
    return HyperNetwork(cfg, rngs=rngs)
  if cfg.kind == "shared":
    return SharedLayer(cfg, rngs=rngs)
  return DiscreteStack(cfg, rngs=rngs)


class LanguageModel(nnx.Module):
  """DiffEqFormer or a baseline, by `cfg.kind` (see module docstring)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    dtype = jnp.dtype(cfg.param_dtype)
    d = cfg.d_model
    # With LoRA, the non-layer weights train only when asked to.
    var = lora.Frozen if cfg.lora_rank and not cfg.lora_train_embeddings else nnx.Param
    embed_std = LLAMA_EMBED_STD if cfg.family == "llama" and not cfg.tie_embeddings else EMBED_STD
    self.embed = var(
      jax.random.normal(rngs.params(), (cfg.vocab_size, d), dtype) * embed_std,
      out_sharding=("vocab", "embed"),
    )
    if cfg.family == "gpt2":
      self.pos_embed = var(
        jax.random.normal(rngs.params(), (cfg.max_len, d), dtype) * POS_EMBED_STD,
        out_sharding=("length", "embed"),
      )
    # `stack` is the layer-weight source (`weight_source`; a hypernetwork for
    # 'diffeqformer'): the name is kept, checkpoints store its state under it.
    self.stack = weight_source(cfg, rngs)
    self.final_norm_scale = var(jnp.ones((d,), dtype), out_sharding=("embed",))
    if cfg.family == "gpt2":
      self.final_norm_shift = var(jnp.zeros((d,), dtype), out_sharding=("embed",))
    if not cfg.tie_embeddings:
      self.head = var(
        jax.random.normal(rngs.params(), (d, cfg.vocab_size), dtype) * EMBED_STD,
        out_sharding=("embed", "vocab"),
      )

  # ---------------------------------------------------------------------------------
  def step_weights(
    self, num_steps: int | None = None, time_grid=None, dtype=None, param_rules=None
  ):
    """What the solver scans: (layer params name -> [K, S, *shape], dt, method).

    ODE kinds: the stack's weights at the stage times of K = `num_steps` uniform steps
    (dt = 1/K) or of `time_grid` [K+1] (dt [K]), solved by `model.solver`. Discrete
    kinds: their L layers, [L, 1, *shape], as Euler steps with dt = 1. `dtype`: default
    the compute dtype. Generated weights are sharded by `param_rules` (see `__call__`).
    """
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype if dtype is None else dtype)
    if not cfg.is_ode:
      return self.stack.step_weights(None, dtype, param_rules), 1.0, "euler"
    times, dt = solvers.solve_times(
      self.resolve_num_steps(num_steps), cfg.solver, cfg.step_time, time_grid
    )
    return self.stack.step_weights(times, dtype, param_rules), dt, cfg.solver

  def step_and_boundary_weights(self, num_steps, time_grid, boundary_times, param_rules=None):
    """`step_weights(num_steps, time_grid)` in the compute dtype, and the stack's weights
    at each time of `boundary_times` (floats or traced scalars; a list of trees of leaves
    [1, 1, *shape]: the local error's extra evaluations), generated together: a
    hypernetwork's W(t) = P·h(t) + P0 is one GEMM over the K·S + B times, so P is read
    once a step, and its gradient written once, not twice (on an H100 a second GEMM of
    owt-small's P cost GBs a step). An ODE kind."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    times, dt = solvers.solve_times(
      self.resolve_num_steps(num_steps), cfg.solver, cfg.step_time, time_grid
    )
    n = times.size
    flat = jnp.concatenate(
      [jnp.reshape(times, (n, 1)).astype(jnp.float32)]
      + [jnp.full((1, 1), t, jnp.float32) for t in boundary_times]
    )
    weights, boundary = {}, [{} for _ in boundary_times]
    for name, w in self.stack.step_weights(flat, dtype, param_rules).items():
      weights[name] = w if w.shape[0] == 1 else w[:n].reshape(times.shape + w.shape[2:])
      for i, at in enumerate(boundary):  # a shared layer's: the same at every time
        at[name] = w if w.shape[0] == 1 else w[n + i : n + i + 1]
    return weights, dt, cfg.solver, boundary

  def layer_weights(self, dtype=None):
    """A discrete model's L layers, name -> [L, *shape] (its step weights, one stage)."""
    if self.config.is_ode:
      raise ValueError(
        f"kind={self.config.kind!r} is an ODE: its weights are W(t) "
        "(step_weights, or materialize it)"
      )
    weights, _, _ = self.step_weights(dtype=dtype)
    return {name: w[:, 0] for name, w in weights.items()}

  def embed_tokens(self, tokens_bl, positions_bl):
    """The initial state x_0 [b, l, d] in the state dtype."""
    cfg = self.config
    dtype = state_dtype(cfg)
    x = jnp.take(constrain(self.embed[...], ("vocab", "embed")), tokens_bl, axis=0)
    if cfg.family == "gpt2":
      x = x + jnp.take(constrain(self.pos_embed[...], ("length", "embed")), positions_bl, axis=0)
    return (x * cfg.embed_scale).astype(dtype)

  def logits(self, x_bld):
    cfg = self.config
    shift = self.final_norm_shift[...] if cfg.family == "gpt2" else None
    dtype = jnp.dtype(cfg.dtype)
    x = blocks.norm(x_bld, self.final_norm_scale[...], shift, cfg.norm_eps).astype(dtype)
    if cfg.tie_embeddings:
      logits = jnp.einsum("bld,vd->blv", x, self.embed[...].astype(dtype))
    else:
      logits = jnp.einsum("bld,dv->blv", x, self.head[...].astype(dtype))
    return constrain(logits, ("batch", "length", "vocab"))

  def resolve_num_steps(self, num_steps: int | None) -> int:
    cfg = self.config
    k = cfg.depth if num_steps is None else int(num_steps)
    if k <= 0:
      raise ValueError(f"num_steps={k} must be positive")
    if not cfg.is_ode and k != cfg.depth:
      raise ValueError(
        f"a discrete '{cfg.kind}' model has {cfg.depth} layers; "
        f"num_steps={k} needs an ODE model (materialize it instead)"
      )
    return k

  def __call__(
    self,
    tokens_bl,
    *,
    segment_ids_bl=None,
    positions_bl=None,
    num_steps: int | None = None,
    deterministic: bool = True,
    dropout_rng=None,
    return_trajectory: bool = False,
    time_grid=None,
    param_rules=None,
    return_local_error: bool = False,
    local_error_step=None,
  ):
    """Logits [b, l, vocab] in the compute dtype.

    Args:
      tokens_bl: int tokens [b, l].
      segment_ids_bl: optional document ids [b, l]; tokens attend only within their id.
      positions_bl: optional positions [b, l] (default 0…l-1); packed data resets them
        per document.
      num_steps: solver steps K (ODE kinds; default `config.depth`).
      deterministic: no dropout when True.
      dropout_rng: PRNG key for dropout when not deterministic.
      return_trajectory: also return the hidden states before each step [K, b, l, d].
      time_grid: optional [K+1] increasing times from 0 to 1 (ODE kinds): step k goes
        from time_grid[k] to time_grid[k+1]; default the uniform grid of `num_steps`
        steps. Training draws random grids with `model.train_time_grid`.
      param_rules: the logical-axis rules the parameters are sharded by, under a mesh:
        weights generated in the call (DiffEqFormer's W(t)) are constrained by them, so
        each lives where its parameters do, while activations follow the rules in
        force. None: generated weights follow the rules in force too.
      return_local_error: also return the solve's local error, Σ_k mean(e_k²) over the
        state's elements and all K steps (`solvers.fixed_step_solve`'s `local_error`,
        with the field at the time the solve never evaluates as its `boundary_inputs`:
        one more evaluation; the train loss adds it times `model.local_error_weight`;
        on every `model.local_error_stride`-th row; the estimate `model.local_error_form`
        says), after the trajectory if asked for.
      local_error_step: where `model.local_error_form` has the halves term ('halves',
        'both'), the step j whose halves the local error compares (an int, or a traced
        int32 the train step draws).
    """
    cfg = self.config
    if time_grid is not None:
      if not cfg.is_ode:
        raise ValueError(f"a discrete '{cfg.kind}' model has no time; time_grid needs an ODE model")
      grid_k = check_time_grid(time_grid)
      if num_steps is not None and int(num_steps) != grid_k:
        raise ValueError(
          f"num_steps={num_steps} and a time_grid of {grid_k} steps disagree; pass one of them"
        )
      num_steps = grid_k
    k = self.resolve_num_steps(num_steps)
    b, length = tokens_bl.shape
    if cfg.family == "gpt2" and length > cfg.max_len:
      raise ValueError(
        f"sequence length {length} exceeds model.max_len={cfg.max_len}; "
        "raise model.max_len or shorten the sequence"
      )
    if positions_bl is None:
      positions_bl = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    use_dropout = (not deterministic) and cfg.dropout_rate > 0.0
    if use_dropout and dropout_rng is None:
      raise ValueError("dropout_rng is required when deterministic=False and dropout > 0")

    x = self.embed_tokens(tokens_bl, positions_bl)
    if use_dropout:
      dropout_rng, embed_rng = jax.random.split(dropout_rng)
      x = blocks._dropout(x, cfg.dropout_rate, embed_rng)
    x = constrain(x, ("batch", "length", "embed"))
    mask = blocks.attention_mask(segment_ids_bl)
    # The local error's extra evaluations: the node terms' left-out step, at the end the
    # solve never evaluates; the halves term's, halfway through step j.
    boundary = halfway = None
    side = "end" if cfg.step_time == "start" else "start"
    nodes = cfg.local_error_nodes
    halves = return_local_error and cfg.local_error_halves
    if halves and local_error_step is None:
      raise ValueError(
        f"model.local_error_form={cfg.local_error_form!r} needs local_error_step, the step j"
      )
    if return_local_error and cfg.is_ode:
      times = [1.0 if side == "end" else 0.0] if nodes else []
      if halves:
        ends = uniform_grid(k) if time_grid is None else time_grid
        times.append(0.5 * (ends[local_error_step] + ends[local_error_step + 1]))
      weights, dt, method, extra = self.step_and_boundary_weights(k, time_grid, times, param_rules)
      boundary, halfway = (extra[0] if nodes else None), (extra[-1] if halves else None)
    else:
      weights, dt, method = self.step_weights(k, time_grid, param_rules=param_rules)
    keys = None
    if use_dropout:  # one key per field evaluation (rk4's 2nd and 3rd share a time;
      # split_euler's attention and MLP parts are an evaluation each)
      n_evals = solvers.num_evals(method)
      keys = jax.random.split(dropout_rng, k * n_evals).reshape(k, n_evals)
    compute = jnp.dtype(cfg.dtype)

    # Rows s apart within each batch shard's R rows, so that they stay on their devices
    # (and a kernel split over the batch still gets whole shards), or gcd(s, R) apart
    # when s does not divide R (R = 1: every row).
    shards = axes.shards("batch")
    shard_rows = b // shards if b % shards == 0 else 1
    stride = cfg.local_error_rows_apart(shard_rows) if return_local_error else 1
    rows = solvers.every_nth_row(stride)

    def field(x_bld, p, key=None, part=None):  # the block (or a splitting solver's
      # part of it) in the compute dtype, x in the state's; on the local error's rows
      # alone (every stride-th: x_bld has fewer rows) at its boundary evaluation
      m, pos = mask, positions_bl
      if x_bld.shape[0] != b:
        m = None if segment_ids_bl is None else blocks.attention_mask(rows(segment_ids_bl))
        pos = rows(positions_bl)
      out = blocks.block_fn(cfg, part)(x_bld.astype(compute), p, cfg, m, pos, key)
      return constrain(out, ("batch", "length", "embed")).astype(x_bld.dtype)

    out = solvers.fixed_step_solve(
      field,
      x,
      weights,
      dt,
      method,
      cfg.remat_policy,
      return_trajectory=return_trajectory,
      eval_inputs=keys,
      num_steps=k,
      unroll=solvers.loop_unroll(cfg.layer_loop, k, blocks._platform()),
      local_error=return_local_error,
      boundary_inputs=boundary,
      boundary=side,
      error_stride=stride,
      error_nodes=nodes,
      error_step=local_error_step if halves else None,
      halves_inputs=halfway,
    )
    if not (return_trajectory or return_local_error):
      return self.logits(out)
    return (self.logits(out[0]),) + tuple(out[1:])

  def with_layers(self, cfg: ModelConfig, layers: dict) -> "LanguageModel":
    """A discrete model of config `cfg` with the stacked `layers` (name -> [L, *shape])
    and this model's embeddings, final norm and head, built without random
    initialisation (every leaf is given). Unsharded, like `create_model` outside a
    mesh."""
    graphdef, state = abstract_model(cfg)
    values = {name: getattr(self, name)[...] for name in _TOP_LEVEL if name in state}
    values["stack"] = {
      "params": {n: jnp.asarray(w, jnp.dtype(cfg.param_dtype)) for n, w in layers.items()}
    }
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def abstract_model(cfg: ModelConfig) -> tuple:
  """(graphdef, state) of a model of config `cfg` with abstract leaves (shapes and dtypes,
  nothing allocated, no random initialisation): fill the state with
  `nnx.replace_by_pure_dict` and `nnx.merge` it to build a model from given weights."""
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def create_model(cfg: ModelConfig, *, seed: int = 0, rngs: nnx.Rngs | None = None):
  """Builds a model. Under `jax.set_mesh(mesh)` + `nnx.logical_axis_rules(rules)` its
  params are created already sharded (inside one jit: no full replica on a host);
  with no mesh in context they are ordinary unsharded arrays."""
  rngs = rngs if rngs is not None else nnx.Rngs(seed)
  if jax.sharding.get_abstract_mesh().empty:
    with nnx.use_eager_sharding(False):
      return LanguageModel(cfg, rngs=rngs)
  return nnx.jit(lambda r: LanguageModel(cfg, rngs=r))(rngs)
