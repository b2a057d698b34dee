"""The jitted functions of training: state creation, the train and eval steps, evaluation.

The loop (`odetransformer/train/loop.py`) carries one `TrainState`: an nnx.State with two
named parts, `state["model"]` and `state["optimizer"]` (the AdamW moments and step
count), created already sharded inside one jit (no full replica on any host). A
`StateLayout` describes it without allocating: graphdef, abstract shapes and the
sharding of every leaf; a resume restores into it (`layout.abstract`) and creates
nothing.

The train step is a pure function of (state, batch, rng) -> (state, metrics), the state
donated; it merges the modules back inside the jit. Every jit that returns a state
(creation, the step) names the layout's shardings as its out_shardings, so a state carries
exactly those — created, restored or stepped — and they never drift (unannotated params
would otherwise get whatever the compiler picks; XLA would also drop size-1 mesh axes:
equivalent shardings, but another program to compile for each form).
"""

from collections.abc import Callable, Iterable
import dataclasses
import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from odetransformer.model import time_grid as time_grid_lib
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import create_model
from odetransformer.train import evaluation
from odetransformer.train import metrics as metrics_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train.losses import token_cross_entropy

# The training state: nnx.State {"model": model state, "optimizer": optimizer state}.
TrainState = nnx.State


# --------------------------------------------------------------------------------------
# State creation (sharded from birth)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class StateLayout:
  """How a TrainState is built and sharded, allocating nothing."""

  graphdef: Any  # nnx.GraphDef of {"model": …, "optimizer": …}
  abstract: TrainState  # ShapeDtypeStructs with concrete shardings
  shardings: TrainState  # the NamedSharding of every leaf (a jit's out_shardings)

  def assemble(self, model_state: nnx.State, opt_state: nnx.State) -> TrainState:
    """A TrainState of these parts with the exact pytree structure of a created one.

    `nnx.State({"model": …, "optimizer": …})` would nest State objects where a created
    state holds plain mappings: another pytree, so the jitted step would be traced and
    compiled a second time at the first step after a restore.
    """
    leaves = jax.tree.leaves(model_state) + jax.tree.leaves(opt_state)
    return jax.tree.unflatten(jax.tree.structure(self.abstract), leaves)

  def merge(self, state: TrainState):
    """(model, optimizer) modules over `state`."""
    parts = nnx.merge(self.graphdef, state)
    return parts["model"], parts["optimizer"]


def _init_fn(cfg: ModelConfig, tx, seed: int):
  def init_fn():
    model = create_model(cfg, seed=seed)
    return {"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)}

  return init_fn


def state_layout(cfg: ModelConfig, tx, seed: int, mesh) -> StateLayout:
  """The TrainState's layout — shapes and shardings — allocating nothing.

  Must run under `nnx.logical_axis_rules(rules)`.
  """
  graphdef, abstract = nnx.get_abstract_model(_init_fn(cfg, tx, seed), mesh)
  return StateLayout(
    graphdef=graphdef, abstract=abstract, shardings=jax.tree.map(lambda a: a.sharding, abstract)
  )


def make_init(layout: StateLayout, cfg: ModelConfig, tx, seed: int) -> Callable:
  """The jitted () -> TrainState of `layout` (from `state_layout` with the same
  arguments): model and optimizer created directly in their shardings. Call it under
  `jax.set_mesh(mesh)` and `nnx.logical_axis_rules`."""
  init_fn = _init_fn(cfg, tx, seed)

  @functools.partial(jax.jit, out_shardings=layout.shardings)
  def init():
    return nnx.state(init_fn())

  return init


def create_train_state(layout: StateLayout, cfg: ModelConfig, tx, seed: int, mesh):
  """The TrainState of `layout` (from `state_layout` with the same arguments), created
  directly in its shardings inside one jit. Must run under `nnx.logical_axis_rules`."""
  init = make_init(layout, cfg, tx, seed)
  with jax.set_mesh(mesh):
    return init()


def init_train_state(cfg: ModelConfig, tx, seed: int, mesh):
  """Creates the TrainState directly in its shardings.

  Must run under `nnx.logical_axis_rules(rules)`. Returns (StateLayout, TrainState).
  """
  layout = state_layout(cfg, tx, seed, mesh)
  return layout, create_train_state(layout, cfg, tx, seed, mesh)


# --------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------
def _with_rules(rules, fn):
  """`fn` called under `nnx.logical_axis_rules(rules)` (which applies when it traces)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with nnx.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  return wrapped


_GRID_STREAM = 0x71D  # folded into a step's rng for its time grid (apart from dropout's)
_INTERP_STREAM = 0x1E9  # … and for model.time_interp_weight's points within the steps
_HALVES_STREAM = 0x4A1  # … and for the step local_error_form's halves term splits


def _logits(
  model, batch, rules, dropout_rng=None, time_grid=None, local_error=False, local_error_step=None
):
  """The model's logits for a (micro)batch; `time_grid`: the solver's [K+1] grid
  (None: uniform); dropout only with a `dropout_rng`; the local error's step j
  `local_error_step` where model.local_error_form has the halves term.

  Generated weights (DiffEqFormer's W(t)) are sharded as their parameters are, by the
  parameter `rules` (the model's `param_rules`): every step that runs the model passes
  them (train and eval alike); otherwise each device would hold all K×S generated
  weights whole."""
  return model(
    batch["inputs"],
    segment_ids_bl=batch.get("segment_ids"),
    positions_bl=batch.get("positions"),
    deterministic=dropout_rng is None,
    dropout_rng=dropout_rng,
    time_grid=time_grid,
    param_rules=rules,
    return_local_error=local_error,
    local_error_step=local_error_step,
  )


def _microbatches(batch, num: int, batch_spec):
  """[B, …] -> [num, B/num, …], microbatch j = rows j, j+num, … (balanced over shards)."""

  def split(x):
    y = x.reshape((x.shape[0] // num, num) + x.shape[1:]).swapaxes(0, 1)
    spec = jax.sharding.PartitionSpec(None, *batch_spec)
    return jax.lax.with_sharding_constraint(y, spec)

  return jax.tree.map(split, batch)


# XLA options of the train step on GPUs. XLA's dot merger joins matmuls that share an
# operand into one GEMM over their concatenated weights (the attention's q, k, v; the
# parallel block's two backward matmuls of one dy), which writes a concatenated input
# and slices the output apart: more bytes a step than the GEMMs it saves
# (benchmarks/README.md, "The train step compiled for an H100"). TPU and CPU keep XLA's
# defaults.
GPU_TRAIN_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def train_step_compiler_options(layout: StateLayout) -> dict | None:
  """The XLA options of the train step for the devices its state lives on (GPUs:
  GPU_TRAIN_STEP_OPTIONS; elsewhere none)."""
  sharding = jax.tree.leaves(layout.shardings)[0]
  on_gpu = sharding.mesh.devices.flat[0].platform == "gpu"
  return dict(GPU_TRAIN_STEP_OPTIONS) if on_gpu else None


def make_train_step(
  layout: StateLayout,
  schedule: Callable,
  rules,
  *,
  grad_accum_steps: int = 1,
  use_dropout: bool = False,
  skip_nonfinite: bool = False,
) -> Callable:
  """The jitted step: (state, batch, rng) -> (state, TrainMetrics); state donated.

  `rules` are the (parameter) logical-axis rules; the step is traced under the
  derived activation rules (`sharding.activation_rules`). Call it under
  `jax.set_mesh(mesh)`.

  With `skip_nonfinite`, a step whose loss or gradient norm is NaN/inf returns the state
  it was given — parameters, Adam moments and every step counter (so the schedule does
  not advance either): the batch is consumed, nothing else happens. Its metrics report
  skipped=1 and leave the loss and gradient-norm means alone. The update sits in a
  `lax.cond`, not a `where` over the new and old state, for which XLA keeps both copies
  (costs in benchmarks/README.md, Skipping non-finite steps). Without it such a step is
  applied like any other and the loop stops at the next check (`health.HealthCheck`).
  """
  batch_spec = sharding_lib.logical_to_spec(("batch", None), rules)

  def loss_fn(params, rest, graphdef, batch, rng, denominator):
    """Σ token losses / denominator (the whole batch's target count) and Σ losses.

    Dividing the scalar loss, not the gradients, keeps the mean out of the per-parameter
    passes (a divide over every gradient would be one more read and write of each).
    """
    model = nnx.merge(graphdef, params, rest)
    # model.train_time_grid: this batch's solver grid (None = uniform), its own stream.
    grid = time_grid_lib.train_time_grid(model.config, jax.random.fold_in(rng, _GRID_STREAM))
    weight = model.config.local_error_penalty  # model.local_error_weight: λ·local error
    step_j = None  # model.local_error_form's halves term: the step it splits, uniform over K
    if weight > 0 and model.config.local_error_halves:
      key = jax.random.fold_in(rng, _HALVES_STREAM)
      step_j = jax.random.randint(key, (), 0, model.config.depth, jnp.int32)
    dropout = rng if use_dropout else None
    out = _logits(
      model, batch, rules, dropout, grid, local_error=weight > 0, local_error_step=step_j
    )
    logits, error = out if weight > 0 else (out, None)
    loss_sum, _ = token_cross_entropy(logits, batch["targets"], batch["weights"])
    loss = loss_sum / denominator
    if error is not None:  # a mean per microbatch: their mean over the accumulation
      loss = loss + weight * error / grad_accum_steps
    interp = model.config.time_interp_penalty  # model.time_interp_weight: μ·off-line W
    if interp:  # the same draw in every microbatch: once over the accumulation
      cfg = model.config
      alpha = jax.random.uniform(jax.random.fold_in(rng, _INTERP_STREAM), (cfg.depth,))
      ends = time_grid_lib.uniform_grid(cfg.depth) if grid is None else grid
      loss = loss + interp * model.stack.interpolation_error(ends, alpha) / grad_accum_steps
    return loss, loss_sum

  def apply_update(state, grads):
    model, optimizer = layout.merge(state)
    optimizer.update(model, grads)  # clips by the global norm first (create_optimizer)
    return nnx.state({"model": model, "optimizer": optimizer})

  def train_step(state, batch, rng):
    model, optimizer = layout.merge(state)
    lr = schedule(optimizer.step[...])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    # The gradient is of the mean over all target tokens of the global batch (exact
    # under accumulation: every microbatch divides by the whole batch's count).
    weight_sum = jnp.sum(batch["weights"].astype(jnp.float32))
    denominator = jnp.maximum(weight_sum, 1.0)
    if grad_accum_steps == 1:
      (_, loss_sum), grads = grad_fn(params, rest, graphdef, batch, rng, denominator)
    else:
      micro = _microbatches(batch, grad_accum_steps, batch_spec)

      def body(carry, xs):
        g_acc, l_acc = carry
        mb, j = xs
        (_, l), g = grad_fn(params, rest, graphdef, mb, jax.random.fold_in(rng, j), denominator)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l), None

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
      (grads, loss_sum), _ = jax.lax.scan(
        body, (zeros, jnp.float32(0)), (micro, jnp.arange(grad_accum_steps))
      )
    # The norm of the whole (accumulated) gradient: the one the optimizer's clipping
    # takes too. Neither the updates nor the new parameters are reduced to norms here:
    # each would be one more pass over every parameter per step (the updates would also
    # stay in memory beside the new parameters). `make_param_norm` measures the
    # parameters when a log line or a checkpoint needs them; a non-finite update shows
    # there, and in the next step's loss.
    grad_norm = optax.global_norm(grads)
    applied = jnp.float32(1.0)
    if skip_nonfinite:
      ok = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
      new_state = jax.lax.cond(ok, apply_update, lambda state, _: state, state, grads)
      loss_sum, weight_sum, grad_norm = (
        jnp.where(ok, x, 0.0) for x in (loss_sum, weight_sum, grad_norm)
      )
      applied = ok.astype(jnp.float32)
    else:
      new_state = apply_update(state, grads)
    out = metrics_lib.TrainMetrics.single_from_model_output(
      loss_sum=loss_sum,
      weight_sum=weight_sum,
      grad_norm=grad_norm,
      learning_rate=lr,
      applied=applied,
    )
    return new_state, out

  return _with_rules(
    sharding_lib.activation_rules(rules),
    jax.jit(
      train_step,
      donate_argnums=(0,),
      out_shardings=(layout.shardings, None),
      compiler_options=train_step_compiler_options(layout),
    ),
  )


def make_param_norm(layout: StateLayout) -> Callable:
  """The jitted global L2 norm of the model's parameters in a TrainState."""

  @jax.jit
  def param_norm(state):
    model, _ = layout.merge(state)
    return optax.global_norm(nnx.state(model, nnx.Param))

  return param_norm


def make_eval_step(layout: StateLayout, rules) -> Callable:
  """The jitted eval step: (state, batch) -> EvalMetrics, by the one scorer
  (`evaluation.score_sums`: the deterministic forward pass at the training K).

  Traced as the train step is: under the activation rules, with generated weights
  sharded by the parameter rules. Call it under `jax.set_mesh(mesh)`."""

  def eval_step(state, batch):
    model, _ = layout.merge(state)
    nll, weight, correct = evaluation.score_sums(model, batch, rules)
    return metrics_lib.EvalMetrics.single_from_model_output(
      loss_sum=nll, weight_sum=weight, correct_sum=correct
    )

  return _with_rules(sharding_lib.activation_rules(rules), jax.jit(eval_step))


# --------------------------------------------------------------------------------------
# Batches: each process its own rows
# --------------------------------------------------------------------------------------
def local_batch(batch, local_batch_size: int | None = None) -> dict:
  """This process's rows of a train or eval batch as the model's numpy arrays
  (`evaluation.host_batch`): a short last eval batch padded to `local_batch_size` rows
  of weight 0. `sharding.global_batch_from_local` makes them one global batch."""
  return evaluation.host_batch(batch, local_batch_size)


def evaluate(
  eval_step,
  state,
  batches: Iterable,
  batch_sharding,
  local_batch_size: int,
  num_eval_steps: int = -1,
) -> dict:
  """The train loop's evaluation: token-weighted loss, perplexity and accuracy over at
  most `num_eval_steps` of `batches` (this process's rows of each), summed on device.

  The same scorer as `python -m odetransformer.evaluate`, which reads the whole split
  (`evaluation.evaluate_model`); with `data.eval_max_batches` set, the two see different
  amounts of text."""
  merged = None
  for i, batch in enumerate(batches):
    if 0 <= num_eval_steps <= i:
      break
    gbatch = sharding_lib.global_batch_from_local(
      local_batch(batch, local_batch_size), batch_sharding, local_batch_size * jax.process_count()
    )
    m = eval_step(state, gbatch)
    merged = m if merged is None else merged.merge(m)
  if merged is None:
    return {}
  out = metrics_lib.summarize(merged.compute())
  out["num_tokens"] = float(merged.loss.count)
  return out
