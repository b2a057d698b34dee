"""Default: a small DiffEqFormer on the embedded corpus, for a laptop CPU.

Every other config imports this one and overrides what differs; this file lists every
key with a comment. The data is the embedded corpus (Python standard library source,
offline everywhere); the tokenizer is trained on it at start and cached in the workdir.

Command:
  python main.py --config=configs/default.py --workdir=/tmp/odet_default

GPT baseline (same width, depth, data and schedule):
  python main.py --config=configs/default.py --config.model.kind=gpt --workdir=/tmp/odet_default_gpt

Expect minutes on a CPU: the wall time, training losses and evaluation perplexities of
both commands are in benchmarks/README.md (Quality). A second run on the same workdir
resumes at step 500 and only evaluates.
"""
import ml_collections

from input_pipeline.config import get_config as get_data_config
from odetransformer.model.config import default_model_config
from odetransformer.train.sharding import rules_to_config


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # --- run length and schedule of side activities (all in optimizer steps) ---------
  config.seed = 0                       # params init, data order and dropout
  config.num_train_steps = 500          # optimizer steps
  config.log_every_steps = 25           # train log line + TensorBoard scalars
  config.eval_every_steps = 250         # evaluation on the eval split (and at the end)
  config.checkpoint_every_steps = 250   # async checkpoint (and at the end)
  config.checkpoint_max_to_keep = 3     # older checkpoints are deleted
  config.checkpoint_async = True        # save in the background while training goes on
  config.workdir_lock_stale_s = 600     # gs:// workdirs: a lock without heartbeat this long is taken over
  config.checkpoint_allow_unverified = False  # restore checkpoints without an integrity record
  config.resume_with_changes = False    # resume despite other data, batch shape or seed

  # --- batch ---------------------------------------------------------------------------
  config.seq_len = 128                  # tokens per training row (packed documents)
  config.global_batch_size = 16         # rows per optimizer step, all devices together
  config.eval_batch_size = 16           # rows per evaluation batch, all devices together

  # --- model: all keys in odetransformer/model/config.py; vocab_size comes from the tokenizer
  config.model = default_model_config()
  config.model.kind = "diffeqformer"    # 'gpt' for the baseline (num_steps = layers)
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 512
  config.model.num_steps = 4            # K Euler steps (the GPT baseline: 4 layers)
  config.model.max_len = 128            # >= seq_len for the gpt flavour
  config.model.time_embed_dim = 32      # d_t
  config.model.time_sinusoids = 128     # S, as the authors' configs (S = 32: ppl 114.9 at step 500)
  config.model.remat_policy = "none"    # tiny activations: recomputing buys nothing
  config.model.dtype = "float32"        # CPU: bf16 is emulated and slower

  # --- data: all keys in input_pipeline/config.py -------------------------------------
  config.data = get_data_config()
  config.data.source = "embedded"       # offline: the Python stdlib's own source files
  config.data.vocab_size = 2048         # SentencePiece vocabulary trained on the train split
  config.data.eval_max_batches = 16     # bound evaluation time (16 × 16 × 128 tokens)

  # --- optimizer: AdamW, 1% warm-up, cosine to 0.1 × peak (odetransformer/train/optimizer.py)
  config.optim = ml_collections.ConfigDict()
  config.optim.name = "adamw"
  config.optim.learning_rate = 1e-3     # peak (3e-3 made the grad norm climb after ~150 steps)
  config.optim.schedule = "cosine"      # 'cosine' | 'constant' (after warm-up)
  config.optim.warmup_frac = 0.02       # warm-up steps = warmup_frac × num_train_steps
  config.optim.min_lr_ratio = 0.1       # final lr = min_lr_ratio × peak
  config.optim.b1 = 0.9
  config.optim.b2 = 0.95                # paper App. C.5: 0.95 helps the ODE
  config.optim.eps = 1e-8
  config.optim.weight_decay = 0.1       # decoupled
  # Decayed group: 'auto' = embeddings only for ODE kinds (as the authors' code), weight
  # matrices and embeddings (not norms, biases) for discrete ones; or 'embeddings' | 'matrices'.
  config.optim.weight_decay_on = "auto"
  config.optim.grad_clip_norm = 1.0     # global-norm clipping (0 = off)
  config.optim.grad_accum_steps = 1     # microbatches per optimizer step
  # Steps with a NaN/inf loss or gradient to skip in a row (state left unchanged, batch
  # consumed) before stopping; 0 = stop at the first, keeping the last good checkpoint.
  config.optim.skip_nonfinite_steps = 0

  # --- mesh: axes (data, fsdp, tensor); -1 = the remaining devices ----------------------
  config.mesh = ml_collections.ConfigDict()
  config.mesh.shape = (1, -1, 1)        # default: fully sharded data parallel
  # Logical axis -> mesh axes ('data,fsdp' = both, '' = replicated); every name of
  # odetransformer/model/axes.py LOGICAL_AXES must be present.
  config.mesh.rules = rules_to_config()

  # --- metrics -------------------------------------------------------------------------
  config.peak_flops_per_device = 0.0    # FLOP/s for MFU; 0 = the device's (table; CPU: measured)
  config.parameter_table = False        # also log every parameter's shape and statistics
  # 'a,b': a jax.profiler trace of train steps a+1..b into <workdir>/tensorboard
  # (TensorBoard's Profile tab, or Perfetto); '' = none.
  config.profile_steps = ""
  return config
