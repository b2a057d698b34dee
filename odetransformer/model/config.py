"""The model config: the one frozen, typed ModelConfig, and the ConfigDict made from it.

`ModelConfig` is the single source of truth: each field carries its default and its
meaning; `default_model_config()` (what `configs/*.py` start from) is generated from the
fields. `model_config(config)` (over `ModelConfig.from_config`) is the only place a
ConfigDict becomes a model config (modules never read ConfigDicts). Every validation
error is one line naming the field and the fix.

Names changed in this release (the old ones still work, each with one warning line;
`migrate_model_fields`): `kind='gpt'` -> `kind='transformer'`; `flavour` -> `family`
(`'gpt'` -> `'gpt2'`); `num_steps` -> `solver_steps` (K, ODE kinds) or `num_layers`
(L, discrete kinds), whichever applies to the kind.
"""

import dataclasses
import logging
import math
import typing

import ml_collections

from odetransformer.errors import ConfigError
from odetransformer.model.solvers import STEP_TIMES
from odetransformer.model.time_grid import TRAIN_TIME_GRIDS

KINDS = ("diffeqformer", "transformer", "parallel", "shared")
ODE_KINDS = ("diffeqformer", "shared")  # depth = model.solver_steps; else model.num_layers
FAMILIES = ("gpt2", "llama")
SOLVERS = ("euler", "midpoint", "rk4", "split_euler")
LLAMA_BLOCKS = ("paper", "reference")
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16", "float64")  # float64: numerical checks
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
LAYER_LOOPS = ("auto", "scan", "unrolled")
LOCAL_ERROR_FORMS = ("steps", "halves", "both")
DEFAULT_DEPTH = 6  # K or L when a config sets neither

# Old name -> new name, for one release (`migrate_model_fields`).
DEPRECATED_KEYS = {"flavour": "family", "num_steps": "solver_steps or num_layers"}
OLD_KINDS = {"gpt": "transformer"}
OLD_FAMILIES = {"gpt": "gpt2"}


def _field(default, meaning: str):
  return dataclasses.field(default=default, metadata={"meaning": meaning})


def depth_fields(kind: str) -> tuple:
  """(the depth field a kind uses, the one it does not): K ('solver_steps') for the ODE
  kinds, L ('num_layers') for the discrete ones."""
  return ("solver_steps", "num_layers") if kind in ODE_KINDS else ("num_layers", "solver_steps")


def reads_local_error(kind: str) -> bool:
  """Whether a kind's train loss applies λ (`local_error_weight`): it has a solve."""
  return kind in ODE_KINDS


def reads_time_interp(kind: str) -> bool:
  """Whether a kind's train loss applies μ (`time_interp_weight`): it has a W(t)."""
  return kind == "diffeqformer"


def unread_fields(model: dict) -> set:
  """Names of the fields a model config (a dict of ModelConfig's fields) does not read:
  the depth its kind does not use (num_layers of an ODE), λ, its stride and its form for a
  kind without a solve, the stride and form where λ is 0, and μ for a kind without W(t)."""
  kind = model.get("kind")
  unread = {depth_fields(kind)[1]}
  if not reads_local_error(kind):
    unread |= {"local_error_weight", "local_error_stride", "local_error_form"}
  elif not model.get("local_error_weight"):
    unread |= {"local_error_stride", "local_error_form"}
  if not reads_time_interp(kind):
    unread.add("time_interp_weight")
  return unread


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Typed, validated model config; each field's meaning is its `meaning` metadata."""

  kind: str = _field(
    "diffeqformer",
    (
      "'diffeqformer': time-dependent weights from hypernetworks (the paper's model); "
      "'transformer': discrete transformer, sequential pre-norm blocks (GPT-2, or Llama "
      "with family='llama'); 'parallel': discrete parallel-block transformer; "
      "'shared': weight-sharing ODE (weights constant in t, Zhong et al. 2022)"
    ),
  )
  family: str = _field(
    "gpt2",
    (
      "'gpt2': LayerNorm, learned positions, GELU, biases; "
      "'llama': RMSNorm, RoPE, SwiGLU, no biases"
    ),
  )
  vocab_size: int = _field(2048, "set from the tokenizer by the training code")
  d_model: int = _field(128, "width d")
  num_heads: int = _field(4, "attention heads (must divide d_model)")
  num_kv_heads: int | None = _field(
    None,
    (
      "key/value heads (grouped-query attention: query head i reads key/value head "
      "i // (num_heads / num_kv_heads), as Llama's checkpoints); must divide num_heads; "
      "None = num_heads (every head its own keys and values)"
    ),
  )
  mlp_dim: int = _field(512, "feed-forward hidden width")
  solver_steps: int | None = _field(
    None, (f"K, solver steps of the ODE kinds (diffeqformer, shared); None = {DEFAULT_DEPTH}")
  )
  num_layers: int | None = _field(
    None, (f"L, layers of the discrete kinds (transformer, parallel); None = {DEFAULT_DEPTH}")
  )
  max_len: int = _field(256, "position table size (gpt2 family); RoPE has no limit")
  time_embed_dim: int = _field(32, "d_t: hypernetwork code width (paper: 20…144)")
  time_sinusoids: int = _field(
    128, ("S: sinusoid pairs in e(t) (size 2S+1); the authors' configs use 128")
  )
  time_hidden: int = _field(0, "H: hypernetwork MLP hidden width; 0 = d_t, as the authors' code")
  time_scale: float = _field(
    1000.0,
    (
      "s of e(t) = [t, sin(s·t·ω_i), cos(s·t·ω_i)], ω_i = 10000^(-i/S): 1000 (the authors') "
      "spans many periods over [0, 1], so W(t) between the training times is free; a "
      "small s (e.g. 10) makes every sinusoid, and so W(t), smooth on [0, 1]"
    ),
  )
  shared_time_mlp: bool = _field(False, "App. D.2 ablation: one MLP shared by all weights")
  solver: str = _field(
    "euler",
    (
      "'euler' | 'midpoint' | 'rk4' | 'split_euler' (ODE kinds only; "
      "odetransformer/model/solvers.py). 'split_euler' (Lie–Trotter, first order): an "
      "Euler substep of the attention update, then one of the MLP update from the "
      "updated state, both at Euler's node: one step is one pre-norm GPT-2/Llama block, "
      "and materialises as one (kind 'transformer'); needs llama_block='paper'"
    ),
  )
  step_time: str = _field(
    "start",
    (
      "where a step evaluates the field (odetransformer/model/solvers.py): 'start' = "
      "Euler's step k at t = k/K (the textbook scheme); 'end' = at (k+1)/K, the authors' "
      "code's scheme (midpoint's nodes reflected too; RK4 the same under both). 'start' "
      "is the default because every earlier run and checkpoint used it"
    ),
  )
  llama_block: str = _field(
    "paper",
    (
      "the Llama-family DiffEqFormer block: 'paper' = F(x) = Attn(N1(x)) + FFN(N2(x)), "
      "the paper's equation, RMSNorms with a time-dependent scale; 'reference' = the "
      "authors' code: the norms also carry a time-dependent shift B·h(t), the FFN reads "
      "N2(N1(x)), block norms use eps 1e-6 (the final norm keeps norm_eps). 'paper' is "
      "the default: it is the paper's model, it scored better than 'reference' at the "
      "authors' init (benchmarks/README.md, Quality), and Llama checkpoints written "
      "before this field hold no norm shifts, so they restore only under it"
    ),
  )
  train_time_grid: str = _field(
    "fixed",
    (
      "training time grid per batch (ODE kinds; odetransformer/model/time_grid.py): "
      "'fixed' = k/K; 'random_shift' = interior times shifted by dt0 ~ U(0, 2/K): every "
      "solver's evaluation points cover [0, 1) under step_time='start' and (0, 1] under "
      "'end'; 'random_offset' = dt0 ~ U(0, 1/K), the authors' scheme: Euler is never "
      "evaluated in [(K-1)/K, 1) under either step_time (only at 1, under 'end'); "
      "'random_uniform' = sorted U(0, 1) interior times, so all step sizes are trained too"
    ),
  )
  local_error_weight: float = _field(
    0.0,
    (
      "λ: the train loss adds λ·Σ_k mean(e_k²), e_k = dt/2·(F_k − F_(k-1)) the "
      "Heun–Euler local error of each of the K steps (ODE kinds; solvers.fixed_step_solve; "
      "the step whose other end the solve never evaluates takes one more field evaluation "
      "there, at t = 1 under step_time='start', 0 under 'end'): a field a finer solve "
      "agrees with; 0 = off. Discrete kinds have no solve and ignore it, so that "
      "--config.model.kind alone switches a config to its baseline"
    ),
  )
  local_error_stride: int = _field(
    1,
    (
      "s: the local error on every s-th row of each batch shard (rows 0, s, 2s, … of its "
      "R rows) alone, an unbiased estimate of it at 1/s of its cost (its elementwise terms "
      "and its one more field evaluation); rows gcd(s, R) apart when s does not divide R, "
      "so that they never leave their devices (the estimate then depends on the mesh); "
      "1 = every row"
    ),
  )
  local_error_form: str = _field(
    "steps",
    (
      "what λ weighs: 'steps' = Σ_k mean(e_k²), each step's Heun–Euler error at the "
      "solve's nodes; 'halves' = K·mean(d_j²) at one step j "
      "drawn per batch, d_j = dt/2·(f(x_j + dt/2·F_j, t_j + dt/2) − F_j) the change that "
      "splitting step j into two Euler halves makes (the field between the nodes), one "
      "field evaluation and no per-step terms; 'both' = 'steps' + 'halves': a step "
      "against a coarser solve's (K/2) and a finer one's (2K) (solvers.fixed_step_solve)"
    ),
  )
  time_interp_weight: float = _field(
    0.0,
    (
      "μ: the train loss adds μ·Σ_groups mean_k ‖W(u_k) − lerp_k‖² / mean_k "
      "‖W(g_(k+1)) − W(g_k)‖² (the denominator held fixed): W(t)'s distance, at a random "
      "u_k in each step of the batch's grid, from the line between the step's ends "
      "(hypernet.HyperNetwork.interpolation_error). W(t) between the trained times, which "
      "a finer solve reads, then lies between its neighbours' (0 = off; only "
      "'diffeqformer' generates W from t: the other kinds ignore it)"
    ),
  )
  train_time_grid_fraction: float = _field(
    1.0,
    (
      "fraction of training batches that draw train_time_grid's random grid; the others "
      "train on the uniform grid k/K (1 = every batch)"
    ),
  )
  remat_policy: str = _field(
    "full", ("'none' | 'full' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'")
  )
  layer_loop: str = _field(
    "auto",
    (
      "how the K solver steps (L layers) run: 'scan' = one lax.scan, whose program and "
      "compile time do not grow with K; 'unrolled' = each step its own code: on a GPU no "
      "loop copies (a scan slices the stacked weights and saved activations with a "
      "device copy per step and stacks them back), for a compile that grows with K "
      "(benchmarks/README.md, 'The train step compiled for an H100'); 'auto' = unrolled "
      "on GPUs up to solvers.MAX_AUTO_UNROLL steps, a scan on TPU and CPU and beyond that"
    ),
  )
  dtype: str = _field(
    "float32", ("compute dtype: 'float32' | 'bfloat16' (params stay param_dtype)")
  )
  attention_impl: str = _field(
    "auto",
    (
      "attention kernel: 'xla' | 'cudnn' (NVIDIA GPUs, bfloat16) | 'splash' (TPU, "
      "Pallas) | 'auto': cudnn on NVIDIA GPUs when dtype and head size allow, splash on "
      "TPU, else xla. One the platform cannot run is an error (`blocks.attention_kernel`)"
    ),
  )
  param_dtype: str = _field("float32", "dtype of the parameters")
  state_dtype: str = _field(
    "float32",
    (
      "dtype of the ODE state / residual stream x carried between steps: 'float32' "
      "keeps an increment dt·F far below |x| that bfloat16 (8 mantissa bits) would "
      "round away"
    ),
  )
  tie_embeddings: bool = _field(True, "LM head = embedding transpose")
  dropout_rate: float = _field(0.0, "on embeddings and on attention / FFN outputs")
  rope_base: float = _field(10000.0, "llama family")
  norm_eps: float = _field(1e-5, "epsilon of the layer / RMS norms")
  embed_scale: float = _field(
    1.0, ("multiplier on input embeddings; 1 as the authors' code (no √d)")
  )
  hyper_init_std: float = _field(
    0.02,
    (
      "DiffEqFormer init as the authors' code (SDML-KU/qkvflow): std of P (weights' "
      "generators) and of the time MLPs' kernels; static parts P0 and all MLP biases "
      "start at 0 (haliax Linear init)"
    ),
  )
  hyper_bias_init_std: float = _field(
    1e-4, ("std of P of the bias generators (qkvflow TemporalLinear f_b)")
  )
  lora_rank: int = _field(
    0,
    (
      "LoRA on a discrete model's stacked layers (fine-tuning; "
      "odetransformer/train/finetune.py): 0 = no adapters; > 0 freezes the layers and "
      "trains A·B"
    ),
  )
  lora_alpha: float = _field(16.0, "adapter scale alpha / rank")
  lora_targets: tuple = _field(
    ("wq", "wk", "wv", "wo"),
    ("layer weights to adapt, comma-separated in a ConfigDict (wq wk wv wo w1 w2 w3)"),
  )
  lora_train_embeddings: bool = _field(
    False, ("also train embeddings, positions, final norm, head")
  )
  out_proj_scale: float = _field(
    1.0,
    (
      "discrete kinds: factor on each layer's W_O, W_2 and their biases (LoRA updates "
      "included). A materialised ODE being fine-tuned keeps dt = 1/N here rather than "
      "in its stored weights, so its residual update is x + dt·layer(x) as in the "
      "authors' code"
    ),
  )

  def __post_init__(self):
    def choice(name, options):
      value = getattr(self, name)
      if value not in options:
        old = {"kind": OLD_KINDS, "family": OLD_FAMILIES}.get(name, {})
        hint = f" (the old name of {old[value]!r})" if value in old else ""
        raise ValueError(f"model.{name}={value!r}{hint} is unknown; choose one of {list(options)}")

    choice("kind", KINDS)
    choice("family", FAMILIES)
    choice("solver", SOLVERS)
    choice("step_time", STEP_TIMES)
    choice("llama_block", LLAMA_BLOCKS)
    choice("train_time_grid", TRAIN_TIME_GRIDS)
    choice("local_error_form", LOCAL_ERROR_FORMS)
    choice("remat_policy", REMAT)
    choice("dtype", DTYPES)
    choice("attention_impl", ATTENTION_IMPLS)
    choice("layer_loop", LAYER_LOOPS)
    choice("param_dtype", DTYPES)
    choice("state_dtype", DTYPES)
    depth, other = self.depth_field, self.unused_depth_field
    if getattr(self, depth) is None:
      if getattr(self, other) is not None:
        raise ValueError(
          f"model.{other}={getattr(self, other)} does not apply to kind={self.kind!r}; "
          f"its depth is model.{depth}: set that instead"
        )
      object.__setattr__(self, depth, DEFAULT_DEPTH)
    for name in (
      "vocab_size",
      "d_model",
      "num_heads",
      "mlp_dim",
      depth,
      "max_len",
      "time_embed_dim",
      "time_sinusoids",
    ):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be a positive integer")
    for name in ("local_error_weight", "time_interp_weight"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be >= 0 (0 = off)")
    if self.local_error_stride < 1:
      raise ValueError(
        f"model.local_error_stride={self.local_error_stride} must be >= 1 (1 = every row)"
      )
    if not self.time_scale > 0:
      raise ValueError(f"model.time_scale={self.time_scale} must be positive")
    if not 0.0 < self.train_time_grid_fraction <= 1.0:
      raise ValueError(
        f"model.train_time_grid_fraction={self.train_time_grid_fraction} must be in (0, 1]"
      )
    if self.d_model % self.num_heads:
      raise ValueError(
        f"model.num_heads={self.num_heads} does not divide "
        f"model.d_model={self.d_model}; pick a divisor of the width"
      )
    if self.num_kv_heads is not None and (
      self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads
    ):
      raise ValueError(
        f"model.num_kv_heads={self.num_kv_heads} must be a positive divisor of "
        f"model.num_heads={self.num_heads} (or unset: as many as the query heads)"
      )
    if self.family == "llama" and self.head_dim % 2:
      raise ValueError(
        f"RoPE needs an even head dim, got {self.head_dim}; change model.d_model or model.num_heads"
      )
    if self.llama_block == "reference" and (self.family != "llama" or self.kind == "transformer"):
      raise ValueError(
        f"model.llama_block='reference' is the authors' Llama DiffEqFormer "
        f"block; this model is family={self.family!r}, kind={self.kind!r}: "
        "use llama_block='paper'"
      )
    if self.llama_block == "reference" and self.is_ode and self.solver == "split_euler":
      raise ValueError(
        "model.llama_block='reference' feeds the FFN N2(N1(x)) within one parallel "
        "block; model.solver='split_euler' steps attention and FFN apart: use "
        "llama_block='paper'"
      )
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")
    if self.lora_rank < 0:
      raise ValueError(f"model.lora_rank={self.lora_rank} must be >= 0")
    if self.lora_rank and self.is_ode:
      raise ValueError(
        "LoRA adapts discrete layers; materialise the ODE first (finetune.method='lora' does this)"
      )
    weights = {"wq", "wk", "wv", "wo", "w1", "w2"} | ({"w3"} if self.family == "llama" else set())
    bad = sorted(set(self.lora_targets) - weights)
    if self.lora_rank and bad:
      raise ValueError(
        f"model.lora_targets has {bad}, not layer weights of this model; "
        f"choose from {sorted(weights)}"
      )
    if self.out_proj_scale <= 0 or (self.is_ode and self.out_proj_scale != 1.0):
      raise ValueError(
        f"model.out_proj_scale={self.out_proj_scale} must be > 0, and 1 for "
        "ODE kinds (their step size is 1/solver_steps)"
      )
    if self.time_hidden < 0:
      raise ValueError(f"model.time_hidden={self.time_hidden} must be >= 0 (0 = d_t)")
    if self.embed_scale <= 0:
      raise ValueError(f"model.embed_scale={self.embed_scale} must be > 0 (1 = unscaled)")
    for name in ("hyper_init_std", "hyper_bias_init_std"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be >= 0")

  @classmethod
  def from_config(cls, config, warn: bool = True) -> "ModelConfig":
    """Builds the model config from `config.model` (a ConfigDict or dict; old names
    migrated, with a warning when `warn`); unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = migrate_model_fields(dict(config), warn)
    targets = values.get("lora_targets")
    if isinstance(targets, str):
      values["lora_targets"] = tuple(t.strip() for t in targets.split(",") if t.strip())
    elif targets is not None:
      values["lora_targets"] = tuple(targets)
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(fields)}")
    return cls(**values)

  @property
  def depth_field(self) -> str:
    """'solver_steps' (ODE kinds) or 'num_layers' (discrete kinds): the field of `depth`."""
    return depth_fields(self.kind)[0]

  @property
  def unused_depth_field(self) -> str:
    return depth_fields(self.kind)[1]

  @property
  def depth(self) -> int:
    """Scan iterations: K (`solver_steps`) for ODE kinds, L (`num_layers`) for discrete ones."""
    return getattr(self, self.depth_field)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads: `num_kv_heads`, or `num_heads` when unset."""
    return self.num_kv_heads or self.num_heads

  @property
  def hyper_hidden(self) -> int:
    return self.time_hidden or self.time_embed_dim

  @property
  def is_ode(self) -> bool:
    return self.kind in ODE_KINDS

  @property
  def local_error_penalty(self) -> float:
    """λ as the train loss applies it: `local_error_weight`, 0 for a discrete kind."""
    return self.local_error_weight if reads_local_error(self.kind) else 0.0

  @property
  def local_error_nodes(self) -> bool:
    """Whether λ's error has the node terms (`local_error_form`)."""
    return self.local_error_form != "halves"

  @property
  def local_error_halves(self) -> bool:
    """Whether λ's error has the halves term (`local_error_form`): a step j to draw."""
    return self.local_error_form in ("halves", "both")

  @property
  def local_error_evaluations(self) -> int:
    """Field evaluations λ's error adds to the solve's (on its rows): one for the node
    terms' left-out step, one for the halves term's midpoint."""
    return int(self.local_error_nodes) + int(self.local_error_halves)

  def local_error_rows_apart(self, shard_rows: int) -> int:
    """How far apart the local error's rows are within a batch shard of `shard_rows`
    rows: `local_error_stride`, or its gcd with `shard_rows` when it does not divide
    them (`model.local_error_stride`)."""
    return math.gcd(self.local_error_stride, shard_rows)

  @property
  def time_interp_penalty(self) -> float:
    """μ as the train loss applies it: `time_interp_weight`, 0 unless 'diffeqformer'."""
    return self.time_interp_weight if reads_time_interp(self.kind) else 0.0

  @property
  def block(self) -> str:
    """'sequential' (GPT-2/Llama pre-norm blocks: the 'transformer' kind) or 'parallel'
    (an ODE's field, and the 'parallel' kind's layers)."""
    return "sequential" if self.kind == "transformer" else "parallel"


def warn_renamed(old: str, new: str) -> None:
  logging.warning("%s is deprecated and will be removed in the next release: use %s", old, new)


def migrate_model_fields(values: dict, warn: bool = True) -> dict:
  """`values` (a model config as a dict) with old names and values replaced by new ones;
  one warning line per old name found (`warn`). New-name dicts come back unchanged; a
  warning (`warn`) when the depth field the kind does not use is set to another value than the
  one it uses (a config may carry K for its ODE beside L for its baseline).
  """
  values = dict(values)
  say = warn_renamed if warn else lambda old, new: None
  kind = values.get("kind", ModelConfig.kind)
  if kind in OLD_KINDS:
    say(f"model.kind={kind!r}", f"model.kind={OLD_KINDS[kind]!r}")
    kind = values["kind"] = OLD_KINDS[kind]
  flavour = values.pop("flavour", None)
  if flavour is not None:
    family = OLD_FAMILIES.get(flavour, flavour)
    say(f"model.flavour={flavour!r}", f"model.family={family!r}")
    values["family"] = family
  if values.get("family") in OLD_FAMILIES:
    family = OLD_FAMILIES[values["family"]]
    say(f"model.family={values['family']!r}", f"model.family={family!r}")
    values["family"] = family
  depth, other = depth_fields(kind)
  num_steps = values.pop("num_steps", None)
  if num_steps is not None:
    say(f"model.num_steps={num_steps}", f"model.{depth}={num_steps} (kind={kind!r})")
    values[depth] = num_steps
  if warn and values.get(depth) is not None and values.get(other) not in (None, values[depth]):
    logging.warning(
      "model.%s=%s is not used by kind=%r: its depth is model.%s=%s",
      other,
      values[other],
      kind,
      depth,
      values[depth],
    )
  return values


def default_model_config() -> ml_collections.ConfigDict:
  """Every ModelConfig field with its default (a tiny CPU-sized DiffEqFormer), plus the
  deprecated keys (unset) so that old command lines still parse."""
  c = ml_collections.ConfigDict()
  for f in dataclasses.fields(ModelConfig):
    if f.default is None:
      c[f.name] = ml_collections.config_dict.placeholder(typing.get_args(f.type)[0])
    elif isinstance(f.default, tuple):
      c[f.name] = ",".join(f.default)
    else:
      c[f.name] = f.default
  c.flavour = ml_collections.config_dict.placeholder(str)
  c.num_steps = ml_collections.config_dict.placeholder(int)
  return c


def model_config(config: ml_collections.ConfigDict, vocab_size=None) -> ModelConfig:
  """The typed model config of a run's config; `vocab_size` (the tokenizer's) overrides
  `model.vocab_size`. Raises ConfigError (one line) on a bad value."""
  model = ml_collections.ConfigDict(config.model.to_dict())
  if vocab_size is not None:
    model.vocab_size = int(vocab_size)
  try:
    return ModelConfig.from_config(model)
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e
