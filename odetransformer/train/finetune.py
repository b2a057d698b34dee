"""Adaptive fine-tuning: start from a pre-trained run at any number of steps N.

A fine-tuning config names the pre-training workdir (`init_from`) and `finetune.*`:

- `continuous`: keep the hypernetworks and train them, run at N steps;
- `full`: materialise N discrete layers (an Euler ODE; a midpoint/rk4 one is not N
  layers and is refused) — or keep a discrete model — and train all weights;
- `lora`: as `full`, then freeze the layers and train low-rank adapters (rank, alpha,
  targets), optionally the embeddings too. `finetune.lora_init`: 'zero_b' (Hu et al.:
  A ~ N(0, 1/in), B = 0) or 'small' (A, B ~ 1e-6·N(0, 1), as the authors' lora.py);
  either way step 0 is the base model (to ~1e-10 with 'small').

A materialised ODE keeps its step size dt = 1/N out of the stored weights
(`materialize(..., fold_dt=False)`, `model.out_proj_scale = dt`), as the authors' code
(SDML-KU/qkvflow) does: full fine-tuning updates W_O, W_2 at the same scale at every N,
and a LoRA update of W_O or W_2 is scaled by dt like the weight it adapts.

The fine-tuning run is an ordinary run: its model config (derived here) is saved with
its checkpoints, so it resumes, evaluates and generates like any other. Only its first
start reads `init_from`. The tokenizer is the pre-training run's.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.errors import ConfigError
from odetransformer.model import blocks, lora
from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import MATERIALIZED_KIND, materialize, materialized_config
from odetransformer.runtime import fileio
from odetransformer.train import loading
from odetransformer.train.checkpoint.paths import CONFIG_FILE
from odetransformer.train.run_config import RunConfig

METHODS = ("continuous", "full", "lora")
LORA_INITS = ("zero_b", "small")
SMALL_LORA_STD = 1e-6  # the authors' lora.py: both factors 1e-6·N(0, 1)
# Fields that must agree with the pre-trained model (the weights are reused); the time
# fields only where the pre-trained model has hypernetworks.
_SHAPE_FIELDS = ("family", "d_model", "num_heads", "mlp_dim", "tie_embeddings", "max_len")
_TIME_FIELDS = ("time_embed_dim", "time_sinusoids", "time_hidden", "shared_time_mlp")


class FinetuneError(ConfigError):
  """A fine-tuning config that cannot start from its `init_from` run."""


def pretrained_config(init_from: str) -> RunConfig:
  """The pre-training run's settings (its model at its data's vocabulary size)."""
  if not init_from or not fileio.exists(fileio.join(init_from, CONFIG_FILE)):
    raise FinetuneError(
      f"init_from={init_from!r} is not a training workdir "
      f"({CONFIG_FILE} missing); point it at a main.py run"
    )
  return loading.load_run_config(init_from)


def finetune_model_config(config: RunConfig, pre: ModelConfig | None = None) -> ModelConfig:
  """The model the fine-tuning run `config` trains (depends on method and N); `pre`: the
  pre-trained model (default: read from `config.finetune.init_from`)."""
  ft = config.finetune
  pre = pretrained_config(ft.init_from).model if pre is None else pre
  method = ft.method
  if method not in METHODS:
    raise FinetuneError(f"finetune.method={method!r} is unknown; choose one of {list(METHODS)}")
  if ft.lora_init not in LORA_INITS:
    raise FinetuneError(
      f"finetune.lora_init={ft.lora_init!r} is unknown; choose one of {list(LORA_INITS)}"
    )
  fields = _SHAPE_FIELDS + (_TIME_FIELDS if pre.kind == "diffeqformer" else ())
  for field in fields:
    if getattr(config.model, field) != getattr(pre, field):
      raise FinetuneError(
        f"model.{field}={getattr(config.model, field)!r} differs from the pre-trained "
        f"model's {getattr(pre, field)!r} (init_from={ft.init_from}); remove the override"
      )
  n = int(ft.solver_steps or 0) or pre.depth
  if n <= 0:
    raise FinetuneError(
      f"finetune.solver_steps={n} must be positive; set it to the N to "
      "fine-tune at, or leave it unset for the pre-trained K"
    )
  keep = dict(
    dropout_rate=config.model.dropout_rate,
    remat_policy=config.model.remat_policy,
    dtype=config.model.dtype,
  )
  if method == "continuous":
    if not pre.is_ode:
      raise FinetuneError(
        f"finetune.method='continuous' needs an ODE model; the "
        f"pre-trained model is kind={pre.kind!r}; use "
        "finetune.method='full' or 'lora'"
      )
    return dataclasses.replace(pre, solver_steps=n, num_layers=n, **keep)
  if pre.is_ode and pre.solver not in MATERIALIZED_KIND:
    raise FinetuneError(
      f"finetune.method={method!r} materialises N layers, one per Euler or split-Euler "
      f"step, a different function from this {pre.solver!r}-solved model; use "
      "finetune.method='continuous'"
    )
  if pre.is_ode:  # N parallel (Euler) or sequential (split Euler) layers, dt unfolded
    disc = dataclasses.replace(materialized_config(pre, n, fold_dt=False), **keep)
  else:
    if n != pre.depth:
      raise FinetuneError(
        f"finetune.solver_steps={n}: the pre-trained model is a discrete "
        f"{pre.kind!r} model of {pre.depth} layers; leave "
        "finetune.solver_steps unset, or fine-tune an ODE run"
      )
    disc = dataclasses.replace(pre, **keep)
  if method == "full":
    return disc
  return dataclasses.replace(
    disc,
    lora_rank=int(ft.lora_rank),
    lora_alpha=float(ft.lora_alpha),
    lora_targets=tuple(t.strip() for t in str(ft.targets).split(",") if t.strip()),
    lora_train_embeddings=ft.train_embeddings,
  )


def prepare(config: RunConfig) -> RunConfig:
  """`config` with what a fine-tuning run inherits filled in: the model it trains (for
  the record too) and the pre-trained run's tokenizer."""
  init_from = config.finetune.init_from
  pre = pretrained_config(init_from)
  cfg = finetune_model_config(config, pre.model)
  data = config.data
  if not data.tokenizer_path:
    tokenizer = loading.workdir_tokenizer(init_from)
    path = fileio.local_copy(tokenizer) if tokenizer else pre.data.tokenizer_path
    data = dataclasses.replace(data, tokenizer_path=path)
  if data.vocab_size != pre.data.vocab_size:
    raise FinetuneError(
      f"data.vocab_size={data.vocab_size} differs from the "
      f"pre-trained run's {pre.data.vocab_size}; remove the override (the "
      "pre-trained run's tokenizer is reused)"
    )
  return config.replace(model=cfg, data=data)


def initial_model_state(config: RunConfig, cfg: ModelConfig, mesh=None) -> nnx.State:
  """The pre-trained weights transformed for this method (values for `nnx.update`).

  Restored sharded on `mesh` (default: the pre-training run's mesh on this job's
  devices) under this run's logical-axis rules, and transformed there. Leaves it lacks
  (LoRA factors with 'zero_b') keep the new model's initialisation.
  """
  loaded = loading.load_model(
    config.finetune.init_from,
    mesh=mesh,
    rules=config.mesh.rules,
    allow_unverified=config.checkpoint.allow_unverified,
  )
  model = loaded.model
  if config.finetune.method != "continuous" and model.config.is_ode:
    model = materialize(model, cfg.depth, fold_dt=False)
  state = nnx.state(model)
  if cfg.lora_rank and config.finetune.lora_init == "small":
    state = nnx.State(
      {
        **nnx.to_pure_dict(state),
        "stack": {
          **nnx.to_pure_dict(state)["stack"],
          "lora": small_lora_factors(cfg, config.batch.seed),
        },
      }
    )
  return state


def place_initial_weights(config: RunConfig, cfg: ModelConfig, model_state: nnx.State) -> tuple:
  """Fills `model_state` in place with the `init_from` run's (transformed) weights.

  `model_state` is this run's model state: of the leaves the source has, only shape,
  dtype and sharding are read (they may be abstract, `jax.ShapeDtypeStruct`s with a
  sharding); the leaves it lacks (LoRA factors) keep their value, so those must hold
  their fresh initialisation. The source is restored sharded on the same mesh and moved
  into this run's shardings on device (no process gathers the model; multi-process
  safe). Every loaded leaf must exist in this model with the same shape.
  Returns (arrays loaded, arrays in the model).
  """
  target = nnx.to_pure_dict(model_state)
  source = nnx.to_pure_dict(initial_model_state(config, cfg, loading.model_mesh(target)))
  pairs = []  # (container, key, source value, target leaf)

  def match(dst, src, path):
    for key, value in src.items():
      where = f"{path}/{key}"
      if key not in dst:
        raise FinetuneError(
          f"init_from weight {where} has no place in this model; point "
          "init_from at a run of this model's shape"
        )
      if isinstance(value, dict):
        match(dst[key], value, where)
        continue
      if tuple(value.shape) != tuple(dst[key].shape):
        raise FinetuneError(
          f"init_from weight {where} has shape {tuple(value.shape)}, "
          f"this model {tuple(dst[key].shape)}; point init_from at a run "
          "of this model's shape"
        )
      pairs.append((dst, key, value, dst[key]))

  match(target, source, "")
  on_mesh, on_host = [], []  # restored arrays / host values (fresh LoRA factors)
  for p in pairs:
    same = isinstance(p[2], jax.Array) and p[2].sharding.device_set == p[3].sharding.device_set
    (on_mesh if same else on_host).append(p)
  if on_mesh:  # one program moves every restored array into its place
    moved = jax.jit(
      lambda vs: [v.astype(t.dtype) for v, (_, _, _, t) in zip(vs, on_mesh)],
      out_shardings=[t.sharding for _, _, _, t in on_mesh],
    )([v for _, _, v, _ in on_mesh])
    for (dst, key, _, _), value in zip(on_mesh, moved):
      dst[key] = value
  for dst, key, value, old in on_host:
    host = np.asarray(value).astype(old.dtype)
    dst[key] = jax.make_array_from_callback(host.shape, old.sharding, lambda i, h=host: h[i])
  nnx.replace_by_pure_dict(model_state, target)
  return len(pairs), len(jax.tree.leaves(target))


def small_lora_factors(cfg: ModelConfig, seed: int) -> dict:
  """{target: {'a': [L, in, r], 'b': [L, r, out]}}, every entry 1e-6·N(0, 1).

  With both factors this small, A·B ≈ 0 at step 0, yet both get gradients from the first
  step (with B = 0, A's gradient is 0 until B moves).
  """
  specs = blocks.layer_param_specs(cfg)
  key = jax.random.key(seed)
  dtype = jnp.dtype(cfg.param_dtype)
  out = {}
  for i, name in enumerate(cfg.lora_targets):
    a_shape, b_shape = lora.factor_shapes(specs[name], cfg.lora_rank, cfg.depth)
    ka, kb = jax.random.split(jax.random.fold_in(key, i))
    out[name] = {
      "a": SMALL_LORA_STD * jax.random.normal(ka, a_shape, dtype),
      "b": SMALL_LORA_STD * jax.random.normal(kb, b_shape, dtype),
    }
  return out
