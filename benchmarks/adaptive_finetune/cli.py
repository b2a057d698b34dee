"""Adaptive fine-tuning (paper Fig. 5) at CPU scale, run the way the authors' code runs it.

For each seed: pre-train a DiffEqFormer with K Euler steps and a GPT baseline with
round(4K/3) layers (the paper's 18 steps vs 24 layers) on one text, then fine-tune both
on another: the DiffEqFormer at N ∈ {K/2, K, 3K/2} steps with each method, the GPT at
its own depth (full and LoRA). Methods, as the authors' finetune.py / lora.py /
config/finetune/*.yaml (SDML-KU/qkvflow) define them:

- full: the ODE is materialised as N discrete layers W(t_k), with the step size dt = 1/N
  kept on each layer's residual update (x + dt·layer(x)), not folded into W_O/W_2, so
  AdamW updates the same weights at the same scale at every N; every weight trains.
- lora: as full, then the layers freeze and every linear map (W_Q, W_K, W_V, W_O, W_1,
  W_2) gets an adapter ΔW = (alpha/r)·A·B with A, B ~ 1e-6·N(0, 1); ΔW lies under dt
  like the weight it adapts. Adapters and embeddings train.
- continuous: keep the hypernetworks and train them, run at N steps (ours; the
  authors' code fine-tunes materialised models only).

The DiffEqFormer is pre-trained once per `--pretrain_grids` entry (`model.train_time_grid`:
'fixed' = the uniform K-step grid, as the paper; 'random_offset' = a random offset of the
grid per batch, which holds up better at N ≠ K) and each is fine-tuned the same way; the
table also gives each pre-trained model's validation perplexity on the fine-tuning text
before any fine-tuning, at every N (where fine-tuning starts).

One learning rate for pre-training and every fine-tuning method (the authors use 3e-4
for all), 1% warm-up then cosine to 0.1×, AdamW β2 0.999 (levanter's default, which
those configs keep) and weight decay 0.1. LoRA: the authors use rank 200 at width 1024
with alpha 8; here the rank keeps its share of the width (r = round(200·d/1024)) and
alpha stays 8, as Hu et al. keep alpha when they change r; `--lora_rank=200` gives the
literal rank (then r > d and the adapters are not low-rank at this width).

Writes `adaptive_finetune.md` (mean ± std validation perplexity over seeds, method × N,
and the GPT rows; then every seed's values) and `adaptive_finetune.png` to --out, and
prints the table; the last line is the key ratio (< 1: DiffEqFormer better), per
pre-training grid:

  diffeqformer/gpt fine-tuned perplexity ratio at N=K: fixed: full R, lora R;
  random_offset: full R, lora R (mean of S seeds)

  python -m benchmarks.adaptive_finetune --data_dir=DIR --out=/tmp/adaptive
  python -m benchmarks.adaptive_finetune --data_dir=DIR --seeds=1 --pretrain_steps=10 \\
      --finetune_steps=5 --k=2 --steps=1,2

From runs pre-trained elsewhere (`--pretrained_diffeqformer=D1 --pretrained_gpt=D2`,
e.g. the checkpoints of `benchmarks.single_epoch`), nothing is pre-trained: K, the GPT's
depth, the shape, sequence length, batch, vocabulary and tokenizer are the runs', the
DiffEqFormer's time grid is its run's, and the seeds are fine-tuning seeds (data order,
adapter init, dropout) from the same two pre-trained models:

  python -m benchmarks.adaptive_finetune --data_dir=DIR --out=D3 \
      --pretrained_diffeqformer=D1 --pretrained_gpt=D2 --finetune_steps=100

DIR holds wikitext-2/{valid,test}.txt (pre-training train/eval text) and
tinyshakespeare/input.txt (fine-tuning text: first 90% train, last 10% validation), or
pass the three files with --pretrain_train, --pretrain_eval and --finetune_text.
Runs in --out of the same code and config are reused (`common.keyed_run`; a finished
one is only evaluated again and its line says so, naming the code version), so an
interrupted benchmark continues where it stopped; runs of other code or another config
(a fine-tuning run: or from another pre-trained run) are moved aside and trained
afresh; a persistent compilation cache in --out (or JAX_COMPILATION_CACHE_DIR's, when
set) lets later seeds skip XLA compilation.
"""

import os
import time

from absl import logging
import jax

from benchmarks.adaptive_finetune.report import write_report
from benchmarks.adaptive_finetune.runs import (
  METHODS,
  before_finetuning,
  finetune,
  pretrain_all,
  reused,
  run_dir,
  split_text,
)
from odetransformer import cli_flags, errors
from odetransformer.errors import ConfigError
from odetransformer.model.config import model_config
from odetransformer.model.time_grid import TRAIN_TIME_GRIDS
from odetransformer.train.checkpoint.fingerprint import load_config
from odetransformer.train.checkpoint.paths import CONFIG_FILE


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define(
    "string",
    "out",
    "/tmp/odet_adaptive_finetune",
    "runs, table and plot (finished runs here are reused)",
  )
  define("integer", "seeds", 3, "number of seeds")
  define(
    "integer",
    "first_seed",
    0,
    "seeds first_seed..first_seed+S-1 (run seeds in parallel processes "
    "with the same --out; a final run over all of them reuses their runs)",
  )
  define("integer", "k", 6, "DiffEqFormer pre-training steps K")
  define("string", "steps", "", "fine-tuning N values, comma-separated (default K/2,K,3K/2)")
  define(
    "integer", "gpt_layers", 0, "GPT baseline depth (default round(4K/3): the paper's 24 vs K=18)"
  )
  define("integer", "d_model", 64, "model width (mlp = 4·d)")
  define("integer", "time_embed_dim", 32, "d_t of the DiffEqFormer")
  define(
    "integer",
    "time_sinusoids",
    32,
    "S; 32 at this width (d 64), the size the figures were measured at",
  )
  define("integer", "seq_len", 64, "sequence length")
  define("integer", "batch", 16, "global batch size")
  define("integer", "vocab", 1024, "SentencePiece vocabulary size")
  define("integer", "pretrain_steps", 300, "pre-training steps")
  define("integer", "finetune_steps", 60, "fine-tuning steps of each method and N")
  define("float", "lr", 1e-3, "peak lr of pre-training and of every fine-tuning method")
  define("float", "b2", 0.999, "AdamW beta2")
  define("integer", "lora_rank", 0, "default round(200·d/1024), the authors' share of the width")
  define("float", "lora_alpha", 8.0, "LoRA alpha")
  define(
    "string",
    "pretrain_grids",
    "fixed,random_offset",
    "DiffEqFormer pre-training time grids (model.train_time_grid), each pre-trained and fine-tuned",
  )
  define(
    "string",
    "methods",
    ",".join(METHODS),
    "fine-tuning methods to run (the GPT runs the discrete ones)",
  )
  define("integer", "eval_batches", 8, "evaluation batches per score")
  define(
    "string",
    "data_dir",
    "",
    "directory with wikitext-2/{valid,test}.txt and tinyshakespeare/input.txt",
  )
  define("string", "pretrain_train", "", "pre-training text (UTF-8)")
  define("string", "pretrain_eval", "", "pre-training evaluation text")
  define("string", "finetune_text", "", "fine-tuning text: first 90% train, last 10% validation")
  define(
    "string",
    "pretrained_diffeqformer",
    "",
    "a pre-trained DiffEqFormer workdir to fine-tune instead of "
    "pre-training (with --pretrained_gpt; shape, K and grid are the run's)",
  )
  define(
    "string",
    "pretrained_gpt",
    "",
    "the pre-trained GPT baseline's workdir (with --pretrained_diffeqformer)",
  )


def parse_args(argv=None):
  """The flags of `argv` (without the program name; default sys.argv[1:]), checked: a
  bad value is a UserError naming the fix."""
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  args.pretrained = bool(args.pretrained_diffeqformer or args.pretrained_gpt)
  defaults = (
    {}
    if args.pretrained
    else {
      "pretrain_train": ("wikitext-2", "valid.txt"),
      "pretrain_eval": ("wikitext-2", "test.txt"),
    }
  )
  defaults["finetune_text"] = ("tinyshakespeare", "input.txt")
  for flag, parts in defaults.items():
    if not getattr(args, flag) and args.data_dir:
      setattr(args, flag, os.path.join(args.data_dir, *parts))
    if not os.path.isfile(getattr(args, flag)):
      raise errors.UserError(
        f"--{flag}={getattr(args, flag)!r} is not a file; pass it, or --data_dir=DIR "
        f"with {'/'.join(parts)} in DIR"
      )
  if args.seeds < 1 or args.k < 1:
    raise errors.UserError(
      f"--seeds={args.seeds} and --k={args.k} must be at least 1; pass positive values"
    )
  if args.pretrained:
    try:
      from_pretrained(args)
    except (ConfigError, OSError, ValueError) as e:
      raise errors.UserError(str(e)) from e
  try:
    args.ns = (
      [int(n) for n in args.steps.split(",")]
      if args.steps
      else sorted({max(1, args.k // 2), args.k, (3 * args.k) // 2})
    )
  except ValueError as e:
    raise errors.UserError(
      f"--steps={args.steps!r} is not a list of step counts; pass integers, comma-separated "
      "(e.g. --steps=3,6,9)"
    ) from e
  args.gpt_layers = args.gpt_layers or max(1, round(4 * args.k / 3))
  args.lora_rank = args.lora_rank or max(1, round(200 * args.d_model / 1024))
  args.methods = [m for m in METHODS if m in args.methods.split(",")]
  if args.pretrained:
    return args
  args.grids = [g for g in args.pretrain_grids.split(",") if g]
  bad = [g for g in args.grids if g not in TRAIN_TIME_GRIDS]
  if bad or not args.grids:
    raise errors.UserError(
      f"--pretrain_grids={args.pretrain_grids!r}: choose from {list(TRAIN_TIME_GRIDS)}"
    )
  return args


def from_pretrained(args) -> None:
  """Sets K, the GPT's depth, the grid, the width and the pre-training steps of `args`
  from the two pre-trained runs (ConfigError naming the flag when one is not usable)."""
  models = {}
  for flag, kind in (
    ("pretrained_diffeqformer", "diffeqformer"),
    ("pretrained_gpt", "transformer"),
  ):
    src = getattr(args, flag)
    if not src or not os.path.isfile(os.path.join(src, CONFIG_FILE)):
      raise ConfigError(
        f"--{flag}={src!r} is not a training workdir ({CONFIG_FILE} "
        "missing); pass both --pretrained_diffeqformer and --pretrained_gpt"
      )
    config = load_config(src)
    models[kind] = model_config(config, config.data.vocab_size)
    if models[kind].kind != kind:
      raise ConfigError(f"--{flag}={src} holds a {models[kind].kind!r} model, not {kind!r}")
    if kind == "diffeqformer":
      args.pretrain_steps = int(config.num_train_steps)
  ode, gpt = models["diffeqformer"], models["transformer"]
  if (ode.d_model, ode.vocab_size) != (gpt.d_model, gpt.vocab_size):
    raise ConfigError(
      "--pretrained_diffeqformer and --pretrained_gpt differ in width or "
      "vocabulary; pass two runs of one comparison"
    )
  args.k, args.gpt_layers, args.grids = ode.solver_steps, gpt.depth, [ode.train_time_grid]
  args.d_model = ode.d_model


def main(argv=None):
  args = parse_args(argv)
  logging.set_verbosity(logging.WARNING)
  os.makedirs(args.out, exist_ok=True)
  # Every seed compiles the same programs: a persistent cache skips XLA after seed 0 (the
  # caller's, when jax already has one: JAX_COMPILATION_CACHE_DIR, e.g. the tests').
  jax.config.update(
    "jax_compilation_cache_dir",
    jax.config.jax_compilation_cache_dir or os.path.join(args.out, "jax_cache"),
  )
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # XLA:CPU compiles the (per-seed, so uncached) parameter init faster with 'rbg'.
  jax.config.update("jax_default_prng_impl", "rbg")
  files = split_text(args.finetune_text, args.out)
  if args.pretrained:
    print(
      f"pre-trained runs (not trained here): DiffEqFormer {args.pretrained_diffeqformer} "
      f"(K = {args.k}, {args.grids[0]} grid), GPT {args.pretrained_gpt} "
      f"({args.gpt_layers} layers); seeds are fine-tuning seeds",
      flush=True,
    )
  cache = os.path.join(args.out, "cache")
  ode, start_ppl, gpt = {}, {}, {}  # (grid, method, N) / (grid, N) / method -> [ppl per seed]
  t0 = time.perf_counter()
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  for seed in seeds:
    work = os.path.join(args.out, f"seed{seed}")
    if args.pretrained:  # the same two runs for every fine-tuning seed
      pre = {
        (args.grids[0], "diffeqformer"): args.pretrained_diffeqformer,
        ("fixed", "transformer"): args.pretrained_gpt,
      }
    else:
      pre = pretrain_all(args, seed, work, cache)
    for grid in args.grids:
      before = before_finetuning(args, pre[grid, "diffeqformer"], args.ns, files[1])
      for n, ppl in zip(args.ns, before):
        start_ppl.setdefault((grid, n), []).append(ppl)
      print(
        f"seed {seed} diffeqformer {grid} before fine-tuning, N={args.ns}: "
        f"{', '.join(f'{p:.2f}' for p in before)}",
        flush=True,
      )
      for method in args.methods:
        for n in args.ns:
          ppl, note = finetune(
            args,
            pre[grid, "diffeqformer"],
            method,
            n,
            seed,
            os.path.join(work, run_dir(grid, f"ft_{method}_{n}")),
            cache,
            files,
          )
          ode.setdefault((grid, method, n), []).append(ppl)
          print(
            f"seed {seed} diffeqformer {grid} {method:10s} N={n:2d}: {ppl:8.2f}{reused(note)}",
            flush=True,
          )
    gpt.setdefault("before", []).append(
      before_finetuning(args, pre["fixed", "transformer"], [None], files[1])[0]
    )
    for method in [m for m in ("full", "lora") if m in args.methods]:
      ppl, note = finetune(
        args,
        pre["fixed", "transformer"],
        method,
        0,
        seed,
        os.path.join(work, f"ft_gpt_{method}"),
        cache,
        files,
      )
      gpt.setdefault(method, []).append(ppl)
      print(
        f"seed {seed} gpt          {method:10s} L={args.gpt_layers:2d}: {ppl:8.2f}{reused(note)}",
        flush=True,
      )
    print(f"seed {seed} done at {time.perf_counter() - t0:.0f} s", flush=True)

  write_report(args, seeds, ode, start_ppl, gpt)
