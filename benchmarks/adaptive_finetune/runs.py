"""The runs of `benchmarks.adaptive_finetune`: the settings every run shares, the
pre-training and fine-tuning configs (from the flags or from a pre-trained run's own
config), the runs themselves (`common.keyed_run`), the pre-trained models' perplexity
before fine-tuning, the run directories' names and the fine-tuning text's split."""

import os

import ml_collections

from benchmarks import common
from configs import default
from odetransformer.train import evaluation
from odetransformer.train.checkpoint.fingerprint import load_config

METHODS = ("continuous", "full", "lora")
LORA_TARGETS = "wq,wk,wv,wo,w1,w2"  # every linear map of a layer


def _run_settings(c, args, seed, cache_dir):
  """What every run of this benchmark shares, set on config `c` (returned): the seed,
  logging, one evaluation and checkpoint at the end, local text, and pre-training's
  and every fine-tuning method's AdamW schedule (the flags' peak rate and b2, 1%
  warm-up, cosine to 0.1x, weight decay 0.1)."""
  with c.unlocked():
    c.seed = seed
    c.log_every_steps = 50
    c.eval_every_steps = 0  # only at the end
    c.checkpoint_every_steps = 0  # only at the end
    c.optim.update(
      dict(learning_rate=args.lr, b2=args.b2, warmup_frac=0.01, min_lr_ratio=0.1, weight_decay=0.1)
    )
    c.data.source = "local"
    c.data.eval_max_batches = args.eval_batches
    c.data.cache_dir = cache_dir  # one tokenizer for every run
  return c


def base_config(args, seed, cache_dir):
  c = _run_settings(default.get_config(), args, seed, cache_dir)
  c.model.d_model, c.model.num_heads, c.model.mlp_dim = args.d_model, 4, 4 * args.d_model
  c.model.time_embed_dim = args.time_embed_dim
  c.model.time_sinusoids = args.time_sinusoids
  c.model.max_len = c.seq_len = args.seq_len
  c.global_batch_size = c.eval_batch_size = args.batch
  c.data.vocab_size = args.vocab
  return c


def pretrained_base(args, seed, cache_dir, src):
  """A fine-tuning config on the pre-trained run `src`'s own config (its model shape,
  sequence length, batch, vocabulary and tokenizer) with this benchmark's settings."""
  c = _run_settings(load_config(src), args, seed, cache_dir)
  with c.unlocked():
    c.data.tokenizer_path = ""  # the pre-trained run's (finetune.prepare)
  return c


def pretrain(args, kind, layers, seed, workdir, cache_dir, grid="fixed"):
  c = base_config(args, seed, cache_dir)
  c.model.kind = kind
  c.model.solver_steps = c.model.num_layers = layers
  c.model.train_time_grid = grid
  c.num_train_steps = args.pretrain_steps
  c.data.train_files, c.data.eval_files = args.pretrain_train, args.pretrain_eval
  return common.keyed_run(c, workdir)


def pretrain_all(args, seed, work, cache_dir) -> dict:
  """Pre-trains one seed's DiffEqFormer per grid and its GPT baseline in `work`:
  (grid, kind) -> workdir."""
  pre = {}
  runs = [(g, "diffeqformer", args.k) for g in args.grids] + [
    ("fixed", "transformer", args.gpt_layers)
  ]
  for grid, kind, layers in runs:
    pre[grid, kind] = os.path.join(work, run_dir(grid, f"pre_{kind}"))
    r, note = pretrain(args, kind, layers, seed, pre[grid, kind], cache_dir, grid)
    print(
      f"seed {seed} pre-trained {kind} ({layers} steps/layers, {grid} grid): eval "
      f"perplexity {r['eval']['perplexity']:.2f}{reused(note)}",
      flush=True,
    )
  return pre


def finetune(args, init_from, method, n, seed, workdir, cache_dir, files):
  c = (
    pretrained_base(args, seed, cache_dir, init_from)
    if args.pretrained
    else base_config(args, seed, cache_dir)
  )
  c.init_from = init_from
  c.finetune = ml_collections.ConfigDict(
    dict(
      method=method,
      solver_steps=n,
      lora_rank=args.lora_rank,
      lora_alpha=args.lora_alpha,
      targets=LORA_TARGETS,
      lora_init="small",
      train_embeddings=True,
    )
  )
  c.num_train_steps = args.finetune_steps
  c.data.train_files, c.data.eval_files = files
  r, note = common.keyed_run(c, workdir)
  return r["eval"]["perplexity"], note


def reused(note: str) -> str:
  """' (<note>, evaluated now)' for a run `common.keyed_run` reused, else ''."""
  return f" ({note}, evaluated now)" if note else ""


def before_finetuning(args, workdir, ns, valid_file):
  """Validation perplexity on the fine-tuning text of a pre-trained run at each N."""
  results = evaluation.evaluate(
    workdir, ns, data=f"local:{valid_file}", max_batches=args.eval_batches
  )
  return [r.perplexity for r in results]


def run_dir(grid, name):
  """Runs of the fixed grid keep their first names, so older --out dirs are reused."""
  return name if grid == "fixed" else f"{name}_{grid}"


def split_text(path, directory):
  """First 90% (cut at a blank line) for training, the rest for validation."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  cut = text.rfind("\n\n", 0, int(0.9 * len(text)))
  cut = cut if cut > 0 else int(0.9 * len(text))
  paths = (
    os.path.join(directory, "finetune_train.txt"),
    os.path.join(directory, "finetune_valid.txt"),
  )
  for out, part in zip(paths, (text[:cut], text[cut:])):
    with open(out, "w", encoding="utf-8") as f:
      f.write(part)
  return paths
