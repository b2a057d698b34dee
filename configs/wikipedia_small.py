"""DiffEqFormer vs GPT at GPT-2 small size, one epoch of Wikipedia on one GPU.

The architecture and optimizer are configs/owt_small.py's (the authors' GPT-2 small
settings): 12 solver steps (GPT: 12 layers), d 768, 12 heads, MLP 3072, d_t 20, S 128,
dropout 0.1, bf16 compute with f32 params, AdamW peak lr 6e-4, β 0.9/0.999, ε 1e-8,
weight decay 0.1, clipping 1.0, 1% linear warm-up, cosine to 0.1× peak over the run.
What differs, and why:

- The text: the wikipedia-2015 files (DIR/train-*.txt, 102 MB of training articles;
  DIR/valid.txt and DIR/test.txt hold other articles), read as local text. DIR is
  ./wikipedia-2015 unless --config.data.train_files / eval_files (main.py) or --data_dir
  (benchmarks.single_epoch) say where it is.
- One SentencePiece tokenizer of 32,768 pieces, trained on the training files and
  shared by both models: the epoch is 23,281,441 tokens with it (29,274 documents;
  `benchmarks.single_epoch --prepare_only`), so a piece is seen ~700 times on average,
  where the authors' 50k vocabulary (sized for OpenWebText's 9 B tokens) would spend a
  third of GPT's parameters on rows that see a few updates each.
- Batch 64 x 1024 (the authors': 512): at 512 rows the epoch would be ~44 optimizer
  steps (under one step of 1% warm-up); 64 rows leave 350, enough for the warm-up and
  cosine decay to take their shape, and still a GPT-2 small batch that fills an H100
  (nanoGPT's per-device 12-64 rows).
- The eval batch is 64 rows (the logits of 256 x 1024 x 32k in f32 are 34 GB).
- remat 'dots_saveable': 64 x 1024 fits an 80 GB card without recomputing the matmuls.
- num_train_steps is the epoch counted for this tokenizer: `benchmarks.single_epoch`
  counts it again (the most steps that serve no token twice), and evaluates every 10%.

The comparison (both models, 3 seeds, valid and test perplexity on the whole splits,
extra held-out files, the analysis plots of seed 0's DiffEqFormer) is one command:

  python -m benchmarks.single_epoch --config=configs/wikipedia_small.py \\
      --data_dir=DIR --workdir=$W --seeds=3 --eval_text=OTHER_TEXT.txt

One model alone (the tokenizer is trained in the workdir's cache):

  python main.py --config=configs/wikipedia_small.py --workdir=$W \
      --config.data.train_files='DIR/train-*.txt' --config.data.eval_files=DIR/valid.txt
  (the GPT baseline: add --config.model.kind=transformer)

`--config=configs/wikipedia_small.py:tiny` is the same recipe at toy size (d 32, K 2,
32-token rows, vocabulary 512, float32) for CPU tests and the GPU script's dry run.

Expect: both models train one epoch (350 steps) without a token seen twice; the
benchmark prints both perplexities, their ratio and its spread over seeds. No figures
here: they are measured on a GPU and recorded in benchmarks/README.md.
"""

import os

from configs import owt_small

# The corpus directory; main.py's --config.data.* or single_epoch's --data_dir point elsewhere.
DATA_DIR = "wikipedia-2015"


def get_config(variant: str = ""):
  """The GPT-2 small recipe; variant 'tiny' shrinks the model and batch (same recipe)."""
  config = owt_small.get_config()
  config.num_train_steps = 350  # one epoch (single_epoch counts it and sets it)
  config.log_every_steps = 10
  config.eval_every_steps = 35  # 10% of the epoch
  config.checkpoint_every_steps = 100
  config.checkpoint_max_to_keep = 1  # a GPT-2 small DiffEqFormer's state is ~2 GB
  config.seq_len = 1024
  config.global_batch_size = 64
  config.eval_batch_size = 64
  config.model.remat_policy = "dots_saveable"

  config.data.source = "local"
  config.data.train_files = os.path.join(DATA_DIR, "train-*.txt")
  config.data.eval_files = os.path.join(DATA_DIR, "valid.txt")
  config.data.vocab_size = 32768
  config.data.eval_max_batches = 0  # the whole validation split (~1 M tokens)

  if variant == "tiny":
    config.seq_len = 32
    config.global_batch_size = config.eval_batch_size = 2
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.mlp_dim = 128
    config.model.solver_steps = config.model.num_layers = 2
    config.model.max_len = 64
    config.model.time_embed_dim = 8
    config.model.time_sinusoids = 8
    config.model.dtype = "float32"  # CPU: bf16 is emulated and slower
    config.model.remat_policy = "none"
    config.data.vocab_size = 512
    config.data.tokenizer_sample_bytes = 300_000
    config.data.worker_count = 0  # a CPU's few cores: tokenize in-process
  elif variant:
    raise ValueError(f"variant {variant!r}: the variants are '' and 'tiny'")
  return config
