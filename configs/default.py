"""Default: a small DiffEqFormer on the embedded corpus, for a laptop CPU.

Every other config imports this one and overrides what differs; this file lists every
key with a comment. The data is the embedded corpus (Python standard library source,
offline everywhere); the tokenizer is trained on it at start and cached in the workdir.

Command:
  python main.py --config=configs/default.py --workdir=/tmp/odet_default

Transformer baseline (GPT-2 family; same width, depth L = K, data and schedule):
  python main.py --config=configs/default.py --config.model.kind=transformer \
      --workdir=/tmp/odet_default_gpt

Expect: the training loss falls from ≈ ln 2048 at step 1; the DiffEqFormer and the
baseline end at about the same evaluation perplexity (figures, with this command:
benchmarks/README.md, "Quality"). A second run on the same workdir resumes at step 500
and only evaluates.
"""

import ml_collections

from input_pipeline.config import get_config as get_data_config
from odetransformer.model.config import default_model_config
from odetransformer.train.sharding import rules_to_config


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # --- run length and schedule of side activities (all in optimizer steps) ---------
  config.seed = 0  # params init, data order and dropout
  config.num_train_steps = 500  # optimizer steps
  config.log_every_steps = 25  # train log line + TensorBoard scalars
  config.eval_every_steps = 250  # evaluation on the eval split (and at the end)
  config.checkpoint_every_steps = 250  # async checkpoint (and at the end)
  config.checkpoint_max_to_keep = 3  # older checkpoints are deleted
  config.checkpoint_async = True  # save in the background while training goes on
  config.workdir_lock_stale_s = 600  # gs://: a lock this long without heartbeat is taken over
  config.checkpoint_allow_unverified = False  # restore checkpoints without an integrity record
  config.resume_with_changes = False  # resume despite other data, batch shape or seed

  # --- batch ---------------------------------------------------------------------------
  config.seq_len = 128  # tokens per training row (packed documents)
  config.global_batch_size = 16  # rows per optimizer step, all devices together
  config.eval_batch_size = 16  # rows per evaluation batch, all devices together

  # --- model: every ModelConfig field (odetransformer/model/config.py: defaults and
  # full meanings; tests/test_config_migration.py checks this list is complete); vocab_size
  # comes from the tokenizer. The configs set both depths, K for the ODE kinds and L for
  # the discrete ones, so that --config.model.kind alone switches to the baseline.
  config.model = default_model_config()
  config.model.kind = "diffeqformer"  # | 'transformer' (baseline) | 'parallel' | 'shared'
  config.model.family = "gpt2"  # 'gpt2' (LayerNorm, GELU, positions) | 'llama'
  config.model.vocab_size = 2048  # overwritten by the tokenizer's
  config.model.d_model = 128  # width d
  config.model.num_heads = 4  # attention heads
  config.model.num_kv_heads = None  # key/value heads (grouped-query); None = num_heads
  config.model.mlp_dim = 512  # feed-forward hidden width
  config.model.solver_steps = 4  # K Euler steps (ODE kinds: diffeqformer, shared)
  config.model.num_layers = 4  # L layers (discrete kinds: transformer, parallel)
  config.model.max_len = 128  # >= seq_len for the gpt2 family
  config.model.time_embed_dim = 32  # d_t
  config.model.time_sinusoids = 128  # S, as the authors' configs
  config.model.time_hidden = 0  # hypernetwork MLP hidden width; 0 = d_t
  config.model.time_scale = 1000.0  # s of e(t)'s sin(s·t·ω_i): the authors'; small = smooth W(t)
  config.model.shared_time_mlp = False  # App. D.2 ablation: one time MLP for all weights
  config.model.solver = "euler"  # 'euler' | 'midpoint' | 'rk4' | 'split_euler'
  config.model.step_time = "start"  # field at t = k/K ('start') or (k+1)/K ('end')
  config.model.llama_block = "paper"  # 'paper' | 'reference' (the authors' code)
  config.model.train_time_grid = "fixed"  # | 'random_shift' | 'random_offset' | 'random_uniform'
  config.model.train_time_grid_fraction = 1.0  # batches on the random grid; the rest on k/K
  # Perplexity at K/2-8K steps stays within 3% of K's; without it 4K, 8K fall apart
  # (benchmarks/README.md, "Any N").
  config.model.local_error_weight = 3000.0  # λ on the solve's local error (0 = off)
  config.model.local_error_stride = 4  # λ's terms on every s-th row of a batch shard
  config.model.local_error_form = "both"  # steps vs K/2's and 2K's | 'steps' | 'halves'
  config.model.time_interp_weight = 0.0  # μ on W(t)'s distance from the line between nodes
  config.model.remat_policy = "none"  # tiny activations: recomputing buys nothing
  config.model.layer_loop = "auto"  # GPUs: unrolled (no loop copies); TPU, CPU: a scan
  config.model.dtype = "float32"  # CPU: bf16 is emulated and slower
  config.model.attention_impl = "auto"  # | 'xla' | 'cudnn' | 'splash'
  config.model.param_dtype = "float32"  # parameters
  config.model.state_dtype = "float32"  # the residual stream carried between steps
  config.model.tie_embeddings = True  # LM head = embedding transpose
  config.model.dropout_rate = 0.0  # on embeddings and attention / FFN outputs
  config.model.rope_base = 10000.0  # llama family
  config.model.norm_eps = 1e-5  # layer / RMS norms
  config.model.embed_scale = 1.0  # multiplier on input embeddings
  config.model.hyper_init_std = 0.02  # std of the hypernetworks' generators
  config.model.hyper_bias_init_std = 1e-4  # std of the bias generators
  config.model.lora_rank = 0  # 0 = no LoRA adapters (fine-tuning sets them)
  config.model.lora_alpha = 16.0  # adapter scale alpha / rank
  config.model.lora_targets = "wq,wk,wv,wo"  # adapted layer weights
  config.model.lora_train_embeddings = False  # LoRA: also train embeddings, norm, head
  config.model.out_proj_scale = 1.0  # discrete kinds: factor on W_O, W_2

  # --- data: all keys in input_pipeline/config.py -------------------------------------
  config.data = get_data_config()
  config.data.source = "embedded"  # offline: the Python stdlib's own source files
  config.data.vocab_size = 2048  # SentencePiece vocabulary trained on the train split
  config.data.eval_max_batches = 16  # bound evaluation time (16 × 16 × 128 tokens)

  # --- optimizer: AdamW, 1% warm-up, cosine to 0.1 × peak (odetransformer/train/optimizer.py)
  config.optim = ml_collections.ConfigDict()
  config.optim.name = "adamw"
  config.optim.learning_rate = 1e-3  # peak (3e-3 made the grad norm climb after ~150 steps)
  config.optim.schedule = "cosine"  # 'cosine' | 'constant' (after warm-up)
  config.optim.warmup_frac = 0.02  # warm-up steps = warmup_frac × num_train_steps
  config.optim.min_lr_ratio = 0.1  # final lr = min_lr_ratio × peak
  config.optim.b1 = 0.9
  config.optim.b2 = 0.95  # paper App. C.5: 0.95 helps the ODE
  config.optim.eps = 1e-8
  config.optim.weight_decay = 0.1  # decoupled
  # Decayed group: 'auto' = embeddings only for ODE kinds (as the authors' code), weight
  # matrices and embeddings (not norms, biases) for discrete ones; or 'embeddings' | 'matrices'.
  config.optim.weight_decay_on = "auto"
  config.optim.grad_clip_norm = 1.0  # global-norm clipping (0 = off)
  config.optim.grad_accum_steps = 1  # microbatches per optimizer step
  # Steps with a NaN/inf loss or gradient to skip in a row (state left unchanged, batch
  # consumed) before stopping; 0 = stop at the first, keeping the last good checkpoint.
  config.optim.skip_nonfinite_steps = 0

  # --- mesh: axes (data, fsdp, tensor); -1 = the remaining devices ----------------------
  config.mesh = ml_collections.ConfigDict()
  config.mesh.shape = (1, -1, 1)  # default: fully sharded data parallel
  # Logical axis -> mesh axes ('data,fsdp' = both, '' = replicated); every name of
  # odetransformer/model/axes.py LOGICAL_AXES must be present.
  config.mesh.rules = rules_to_config()

  # --- metrics -------------------------------------------------------------------------
  config.peak_flops_per_device = 0.0  # FLOP/s for MFU; 0 = the device's (table; CPU: measured)
  config.parameter_table = False  # also log every parameter's shape and statistics
  # 'a,b': a jax.profiler trace of train steps a+1..b into <workdir>/tensorboard
  # (TensorBoard's Profile tab, or Perfetto); '' = none.
  config.profile_steps = ""
  return config
