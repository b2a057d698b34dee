"""The memory planner's analytic estimate of a train step's temporaries: per-device bytes
by kind (gradients, DiffEqFormer's generated W(t), saved activations per remat policy,
and the head, layer and embedding buffers) and their peak, from the config, the mesh,
the logical-axis rules and the abstract parameters. `memory.py` adds it to the exact
state bytes when it does not compile the step (`--nocompile`).
"""

import math

import jax
import numpy as np

from odetransformer.model import blocks, hypernet, solvers
from odetransformer.model import transformer as model_lib
from odetransformer.train import sharding as sharding_lib


def _axis_size(mesh, rules, name) -> int:
  """Devices the logical axis `name` is split over under `rules`."""
  return sharding_lib.mesh_axis_size(mesh, dict(rules).get(name))


def _logit_bytes(platform: str, cb: int) -> int:
  """Bytes per logit the head holds at its peak, by the loss path and compiler of the
  platform (`losses._token_nll`): on GPUs the fused loss keeps the logits and writes
  their gradient in the compute dtype; XLA:TPU fuses the float32 upcast into the
  softmax (the logits in the compute dtype, their gradient in float32); XLA:CPU keeps
  float32 logits and gradient and, when narrower, compute-dtype copies of both."""
  if platform in ("cuda", "rocm"):
    return 2 * cb
  if platform == "tpu":
    return cb + 4
  return 8 + (2 * cb if cb < 4 else 0)


def temporaries_estimate(config, cfg, mesh, rules, params) -> dict:
  """Per-device bytes the compiled train step holds besides its arguments (the analytic
  path's stand-in for XLA's temporaries), by kind, and their peak.

  Local batch b = global / (batch shards × accumulation), T tokens, width d, MLP f,
  vocabulary V, compute dtype of c bytes (the ODE state: model.state_dtype). A weight
  axis on 'tensor' is split tp ways in activations too, while 'fsdp' splits the batch
  there (`sharding.activation_rules`), so weights are used gathered over fsdp. The kinds:
  * gradients: float32, one per parameter shard; of them, 'hypernetwork gradients'
    (DiffEqFormer: the projections P) are made after the solver's backward scan, from
    the generated W(t)'s gradients;
  * generated W(t): W(t_k) of every solver evaluation in its parameter sharding (c
    bytes) and its float32 gradient, which the backward scan fills;
  * saved activations: per solver evaluation (or layer), what the remat policy keeps:
    the residual input ('full'), or also the matmul outputs and attention scores
    ('dots_*'), or also the elementwise intermediates ('none');
  * head: the logits [b, T, V/tp] and their gradient, in the dtypes the platform's loss
    path keeps (`_logit_bytes`); the embedding gathered over fsdp (tied head; the
    untied head likewise) in c bytes and its float32 gradient;
  * layer: one step's (or layer's) weights gathered over fsdp, twice in c bytes
    (forward and recomputation) and once as a float32 gradient, and the intermediates
    the remat policy recomputes for that step;
  * embedding: the float32 gradient of the gathered embedding tables.
  The head, layer and embedding buffers are live one phase at a time. The peak is the
  larger of 'backward pass' (gradients but the hypernetwork's, generated W(t), saved
  activations, the largest phase) and 'after the scan' (every gradient, the largest
  phase). `python -m benchmarks.memory_estimate` measures it against XLA:CPU's compiled
  step (arguments + temporaries) on 8 devices; `benchmarks/README.md` has the table.
  """
  shards = sharding_lib.num_batch_shards(mesh, rules)
  b = max(1, config.global_batch_size // (shards * int(config.optim.grad_accum_steps)))
  act = sharding_lib.activation_rules(rules)
  tp_heads = _axis_size(mesh, act, "heads")
  tp_mlp = _axis_size(mesh, act, "mlp")
  tp_vocab = _axis_size(mesh, act, "vocab")
  t, d, f, v, n = (config.seq_len, cfg.d_model, cfg.mlp_dim, cfg.vocab_size, cfg.num_heads)
  cb = np.dtype(cfg.dtype).itemsize
  # Whole-field evaluations (split_euler's attention and MLP parts are one between them).
  evals = cfg.depth * (round(solvers.field_cost(cfg.solver)) if cfg.is_ode else 1)
  tokens = b * t

  def shard_elements(tree):
    return sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree))

  out = {"gradients": shard_elements(params) * 4, "hypernetwork gradients": 0, "generated W(t)": 0}
  if cfg.kind == "diffeqformer":
    projections = params.filter(hypernet.Projection)
    out["hypernetwork gradients"] = shard_elements(projections) * 4
    w_t = sum(
      math.prod(x.sharding.shard_shape(x.shape)) // x.shape[-1]
      for x in jax.tree.leaves(projections)
    )
    out["generated W(t)"] = evals * w_t * (cb + 4)

  # Per solver evaluation / layer: matmul outputs (q, k, v, attention, one d-wide
  # output, the MLP's), attention scores, elementwise intermediates.
  glu = 2 if cfg.family == "llama" else 1
  matmul_outs = tokens * (4 * d // tp_heads + d + glu * f // tp_mlp)
  scores = b * (n // tp_heads) * t * t
  elementwise = tokens * (2 * d + glu * f // tp_mlp) + scores  # norms, activations, softmax
  per_eval = 0
  if cfg.remat_policy != "full":
    per_eval += matmul_outs + scores
  if cfg.remat_policy == "none":
    per_eval += elementwise
  sb = np.dtype(model_lib.state_dtype(cfg)).itemsize  # the residual input: the state
  out["saved activations"] = evals * (tokens * d * sb + per_eval * cb)

  def gathered(shape, names):
    """Elements of a weight used gathered over fsdp (split by the activation rules)."""
    return math.prod(shape) // math.prod(_axis_size(mesh, act, nm) if nm else 1 for nm in names)

  emb = gathered((v, d), ("vocab", "embed"))
  if cfg.family == "gpt2":
    emb += gathered((cfg.max_len, d), ("length", "embed"))
  head = 0 if cfg.tie_embeddings else gathered((d, v), ("embed", "vocab"))
  logit_bytes = _logit_bytes(blocks.device_platform(mesh.devices.flat[0]), cb)
  out["head"] = tokens * (v // tp_vocab) * logit_bytes + (emb + head) * (cb + 4)
  layer = sum(gathered(spec.shape, spec.axes) for spec in blocks.layer_param_specs(cfg).values())
  recomputed = (matmul_outs + elementwise) if cfg.remat_policy != "none" else 0
  out["layer"] = layer * (2 * cb + 4) + recomputed * cb
  out["embedding"] = emb * 4
  phase = max(out["head"], out["layer"], out["embedding"])
  out["backward pass"] = (
    out["gradients"]
    - out["hypernetwork gradients"]
    + out["generated W(t)"]
    + out["saved activations"]
    + phase
  )
  out["after the scan"] = out["gradients"] + phase
  out["peak"] = max(out["backward pass"], out["after the scan"])
  return {k: int(x) for k, x in out.items()}
