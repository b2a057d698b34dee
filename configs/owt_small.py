"""Paper: DiffEqFormer at GPT-small shape on OpenWebText (Table 3 / App. C.4).

From the authors' config/owt/small.yaml (SDML-KU/qkvflow), with levanter's optimizer
defaults for what it leaves unset: 12 solver steps (GPT: 12 layers), d 768, 12 heads,
MLP 3072, d_t 20, S 128 sinusoids, sequence 1024, batch 512, 20,000 steps, bf16
compute with f32 params, dropout 0.1. AdamW β1 0.9, β2 0.999, ε 1e-8, weight decay 0.1
(DiffEqFormer: on the embeddings only, as the authors' train_lm.py; the GPT baseline:
weight matrices and embeddings), gradient clipping at 1.0, peak lr 6e-4 with 1% linear
warm-up and cosine decay to 0.1× peak. The authors tokenise with GPT-2's BPE (50,257);
we train SentencePiece with 50,304 pieces (a multiple of 128) on the training split.

Prepare the data once (downloads OpenWebText, builds array_record files):
  python -m input_pipeline.prepare --dataset=openwebtext --data_dir=$DATA
Train (any number of GPUs/TPU chips; the mesh is FSDP over all of them):
  python main.py --config=configs/owt_small.py --workdir=$W --config.data.data_dir=$DATA
GPT baseline:
  python main.py --config=configs/owt_small.py --config.model.kind=transformer --workdir=$W_gpt \
      --config.data.data_dir=$DATA

Expect: validation perplexity in the low 20s at the end, DiffEqFormer at or below the
GPT baseline (paper Table 2; its numbers are not in our copy of the text). Not run by
us: it needs an accelerator (~124 M GPT params; ~188 M DiffEqFormer params at d_t 20).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.num_train_steps = 20_000
  config.log_every_steps = 100
  config.eval_every_steps = 200  # the authors' steps_per_eval
  config.checkpoint_every_steps = 2_000
  config.seq_len = 1024
  config.global_batch_size = 512
  config.eval_batch_size = 256

  config.model.family = "gpt2"
  config.model.d_model = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 3072
  config.model.solver_steps = 12  # K
  config.model.num_layers = 12  # L (the baseline)
  config.model.max_len = 1024
  config.model.time_embed_dim = 20  # d_t
  config.model.time_sinusoids = 128  # S
  config.model.time_hidden = 0  # time-MLP hidden width = d_t, as the authors' code
  # The authors' embed_pdrop and resid_pdrop; their attn_pdrop (dropout on attention
  # probabilities) has no counterpart here: dropout_rate acts on embeddings and residual branches.
  config.model.dropout_rate = 0.1
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"
  config.model.remat_policy = "full"  # 'dots_saveable' is faster where memory allows

  config.data.source = "openwebtext"
  config.data.vocab_size = 50304
  config.data.eval_max_batches = 40  # 40 × 256 × 1024 ≈ 10 M tokens per evaluation
  # Pod hosts have tens of cores: tokenize in 4 worker processes per input shard (one
  # shard per process by default); the stream does not depend on the count.
  config.data.worker_count = 4

  config.optim.learning_rate = 6e-4
  config.optim.schedule = "cosine"
  config.optim.warmup_frac = 0.01  # levanter's default warm-up (1% of the run)
  config.optim.min_lr_ratio = 0.1
  config.optim.b1 = 0.9
  config.optim.b2 = 0.999  # levanter's default (the yaml leaves it unset)
  config.optim.eps = 1e-8
  config.optim.weight_decay = 0.1
  config.optim.grad_clip_norm = 1.0  # levanter's default max_grad_norm
  return config
