"""The model config: ConfigDict defaults and the one frozen, typed ModelConfig.

`default_model_config()` is what `configs/*.py` start from; `model_config(config)` (over
`ModelConfig.from_config`) is the only place a ConfigDict becomes a model config
(modules never read ConfigDicts). Every validation error is one line naming the field
and the fix.
"""
import dataclasses

import ml_collections

from odetransformer.errors import ConfigError
from odetransformer.model.solvers import STEP_TIMES
from odetransformer.model.time_grid import TRAIN_TIME_GRIDS

KINDS = ("diffeqformer", "gpt", "parallel", "shared")
FLAVOURS = ("gpt", "llama")
SOLVERS = ("euler", "midpoint", "rk4")
LLAMA_BLOCKS = ("paper", "reference")
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16", "float64")  # float64: numerical checks
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")


def default_model_config() -> ml_collections.ConfigDict:
  """All model keys with defaults (a tiny CPU-sized DiffEqFormer)."""
  c = ml_collections.ConfigDict()
  # 'diffeqformer': time-dependent weights from hypernetworks (the paper's model);
  # 'gpt': discrete transformer, sequential pre-norm blocks (GPT-2, or Llama with
  #        flavour='llama'); 'parallel': discrete parallel-block transformer;
  # 'shared': weight-sharing ODE (θ constant in t, Zhong et al. 2022).
  c.kind = "diffeqformer"
  c.flavour = "gpt"            # 'gpt': LayerNorm, learned positions, GELU, biases;
                               # 'llama': RMSNorm, RoPE, SwiGLU, no biases
  c.vocab_size = 2048          # set from the tokenizer by the training code
  c.d_model = 128              # width d
  c.num_heads = 4              # attention heads (must divide d_model)
  c.mlp_dim = 512              # feed-forward hidden width
  c.num_steps = 6              # K solver steps (ODE) or L layers (discrete)
  c.max_len = 256              # position table size (gpt flavour); RoPE has no limit
  c.time_embed_dim = 32        # d_t: hypernetwork code width (paper: 20…144)
  c.time_sinusoids = 128       # S: sinusoid pairs in e(t) (size 2S+1); the authors' configs use 128
  c.time_hidden = 0            # H: hypernetwork MLP hidden width; 0 = d_t, as the authors' code
  c.shared_time_mlp = False    # App. D.2 ablation: one MLP shared by all weights
  c.solver = "euler"           # 'euler' | 'midpoint' | 'rk4' (ODE kinds only)
  # Where a step evaluates the field (odetransformer/model/solvers.py): 'start' = Euler's step
  # k at t = k/K (the textbook scheme); 'end' = at (k+1)/K, the authors' code's scheme
  # (midpoint's nodes reflected too; RK4 the same under both). 'start' is the default
  # because every earlier run and checkpoint used it.
  c.step_time = "start"
  # The Llama-flavour DiffEqFormer block: 'paper' = F(x) = Attn(N1(x)) + FFN(N2(x)), the
  # paper's equation, RMSNorms with a time-dependent scale; 'reference' = the authors'
  # code: the norms also carry a time-dependent shift B·h(t), the FFN reads N2(N1(x)),
  # block norms use eps 1e-6 (the final norm keeps norm_eps). 'paper' is the default: it
  # is the paper's model, and Llama checkpoints written before this field hold no norm
  # shifts, so they restore only under it.
  c.llama_block = "paper"
  # Training time grid per batch (ODE kinds; odetransformer/model/time_grid.py): 'fixed' = k/K;
  # 'random_shift' = interior times shifted by dt0 ~ U(0, 2/K): every solver's evaluation
  # points cover [0, 1) under step_time='start' and (0, 1] under 'end';
  # 'random_offset' = dt0 ~ U(0, 1/K), the authors' scheme: Euler is never evaluated
  # in [(K-1)/K, 1) under either step_time (only at 1, under 'end');
  # 'random_uniform' = sorted U(0, 1) interior times, so all step sizes are trained too.
  c.train_time_grid = "fixed"
  c.remat_policy = "full"      # 'none' | 'full' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
  c.dtype = "float32"          # compute dtype: 'float32' | 'bfloat16' (params stay param_dtype)
  # Attention kernel: 'xla' | 'cudnn' (NVIDIA GPUs, bfloat16) | 'splash' (TPU, Pallas) |
  # 'auto': cudnn on NVIDIA GPUs when dtype and head size allow, splash on TPU, else xla.
  # One the platform cannot run is an error (`blocks.attention_kernel`).
  c.attention_impl = "auto"
  c.param_dtype = "float32"
  # dtype of the ODE state / residual stream x carried between steps: 'float32' keeps an
  # increment dt·F far below |x| that bfloat16 (8 mantissa bits) would round away.
  c.state_dtype = "float32"
  c.tie_embeddings = True      # LM head = embedding transpose
  c.dropout_rate = 0.0         # on embeddings and on attention / FFN outputs
  c.rope_base = 10000.0        # llama flavour
  c.norm_eps = 1e-5
  c.embed_scale = 1.0          # multiplier on input embeddings; 1 as the authors' code (no √d)
  # DiffEqFormer initialisation, as the authors' code (SDML-KU/qkvflow) does it:
  c.hyper_init_std = 0.02      # std of P (weights' generators) and of the time MLPs' kernels;
                               # static parts P0 and all MLP biases start at 0 (haliax Linear init)
  c.hyper_bias_init_std = 1e-4 # std of P of the bias generators (qkvflow TemporalLinear f_b)
  # LoRA on a discrete model's stacked layers (fine-tuning; odetransformer/train/finetune.py):
  c.lora_rank = 0              # 0 = no adapters; > 0 freezes the layers and trains A·B
  c.lora_alpha = 16.0          # adapter scale alpha / rank
  c.lora_targets = "wq,wk,wv,wo"   # comma-separated layer weights to adapt (wq wk wv wo w1 w2 w3)
  c.lora_train_embeddings = False  # also train embeddings, positions, final norm, head
  # Discrete kinds: factor on each layer's W_O, W_2 and their biases (LoRA updates
  # included). A materialised ODE being fine-tuned keeps dt = 1/N here rather than in
  # its stored weights, so its residual update is x + dt·layer(x) as in the authors' code.
  c.out_proj_scale = 1.0
  return c


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Typed, validated model config (see `default_model_config` for field meanings)."""
  kind: str = "diffeqformer"
  flavour: str = "gpt"
  vocab_size: int = 2048
  d_model: int = 128
  num_heads: int = 4
  mlp_dim: int = 512
  num_steps: int = 6
  max_len: int = 256
  time_embed_dim: int = 32
  time_sinusoids: int = 128
  time_hidden: int = 0
  shared_time_mlp: bool = False
  solver: str = "euler"
  step_time: str = "start"
  llama_block: str = "paper"
  train_time_grid: str = "fixed"
  remat_policy: str = "full"
  dtype: str = "float32"
  attention_impl: str = "auto"
  param_dtype: str = "float32"
  state_dtype: str = "float32"
  tie_embeddings: bool = True
  dropout_rate: float = 0.0
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  embed_scale: float = 1.0
  hyper_init_std: float = 0.02
  hyper_bias_init_std: float = 1e-4
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple = ("wq", "wk", "wv", "wo")
  lora_train_embeddings: bool = False
  out_proj_scale: float = 1.0

  def __post_init__(self):
    def choice(name, options):
      value = getattr(self, name)
      if value not in options:
        raise ValueError(f"model.{name}={value!r} is unknown; choose one of {list(options)}")

    choice("kind", KINDS)
    choice("flavour", FLAVOURS)
    choice("solver", SOLVERS)
    choice("step_time", STEP_TIMES)
    choice("llama_block", LLAMA_BLOCKS)
    choice("train_time_grid", TRAIN_TIME_GRIDS)
    choice("remat_policy", REMAT)
    choice("dtype", DTYPES)
    choice("attention_impl", ATTENTION_IMPLS)
    choice("param_dtype", DTYPES)
    choice("state_dtype", DTYPES)
    for name in ("vocab_size", "d_model", "num_heads", "mlp_dim", "num_steps", "max_len",
                 "time_embed_dim", "time_sinusoids"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be a positive integer")
    if self.d_model % self.num_heads:
      raise ValueError(f"model.num_heads={self.num_heads} does not divide "
                       f"model.d_model={self.d_model}; pick a divisor of the width")
    if self.flavour == "llama" and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head dim, got {self.head_dim}; "
                       "change model.d_model or model.num_heads")
    if self.llama_block == "reference" and (self.flavour != "llama" or self.kind == "gpt"):
      raise ValueError(f"model.llama_block='reference' is the authors' Llama DiffEqFormer "
                       f"block; this model is flavour={self.flavour!r}, kind={self.kind!r}: "
                       "use llama_block='paper'")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")
    if self.lora_rank < 0:
      raise ValueError(f"model.lora_rank={self.lora_rank} must be >= 0")
    if self.lora_rank and self.is_ode:
      raise ValueError("LoRA adapts discrete layers; materialise the ODE first "
                       "(finetune.method='lora' does this)")
    weights = {"wq", "wk", "wv", "wo", "w1", "w2"} | ({"w3"} if self.flavour == "llama" else set())
    bad = sorted(set(self.lora_targets) - weights)
    if self.lora_rank and bad:
      raise ValueError(f"model.lora_targets has {bad}, not layer weights of this model; "
                       f"choose from {sorted(weights)}")
    if self.out_proj_scale <= 0 or (self.is_ode and self.out_proj_scale != 1.0):
      raise ValueError(f"model.out_proj_scale={self.out_proj_scale} must be > 0, and 1 for "
                       "ODE kinds (their step size is 1/num_steps)")
    if self.time_hidden < 0:
      raise ValueError(f"model.time_hidden={self.time_hidden} must be >= 0 (0 = d_t)")
    if self.embed_scale <= 0:
      raise ValueError(f"model.embed_scale={self.embed_scale} must be > 0 (1 = unscaled)")
    for name in ("hyper_init_std", "hyper_bias_init_std"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be >= 0")

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "ModelConfig":
    """Builds the model config from `config.model`; unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(config)
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
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def hyper_hidden(self) -> int:
    return self.time_hidden or self.time_embed_dim

  @property
  def is_ode(self) -> bool:
    return self.kind in ("diffeqformer", "shared")

  @property
  def block(self) -> str:
    """'sequential' (GPT-2/Llama pre-norm blocks: the 'gpt' kind) or 'parallel' (an ODE's
    field, and the 'parallel' kind's layers)."""
    return "sequential" if self.kind == "gpt" else "parallel"


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
