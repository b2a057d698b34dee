"""One run of `benchmarks.single_epoch`: its config (--config's or the preset's) and
directory name, its training through `common.keyed_run`, and the scores of its
checkpoints on valid, test and each --eval_text: at every evaluation step of the preset
mode (`run_points`), or once at the end of the --config mode's single training call, whose
learning curve is read back from the loop's TensorBoard scalars (`run_whole`)."""

import glob
import os
import struct
import time

import jax
import ml_collections

from benchmarks import common
from benchmarks.single_epoch.corpus import TrainingText
from configs import default
from odetransformer.errors import UserError
from odetransformer.train import evaluation, loading

KINDS = ("diffeqformer", "transformer")
SPLITS = ("valid", "test")
EVALS_FILE = "single_epoch_evals.json"


def run_name(args, kind: str, seed: int, steps: int) -> str:
  """A run's directory name in the workdir; a DiffEqFormer of a random time grid is named
  after its grid (the fixed grid's runs keep the plain names)."""
  grid = f"_{args.ode_grid}" if kind == "diffeqformer" and args.ode_grid != "fixed" else ""
  return f"{kind}{grid}_seed{seed}_steps{steps}"


def make_config(args, kind: str, seed: int, steps: int, root: str):
  """One run's config: --config's (its model, optimizer, batch, dtype) or the preset's on
  configs/default.py, with the seed, kind, steps and the data of --data_dir."""
  if args.base_config is not None:
    c = ml_collections.ConfigDict(args.base_config.to_dict())
    # The loop's own evaluation on valid.txt draws the learning curve (one training
    # call per run: no recompilation at each point).
    c.eval_every_steps = args.eval_every or max(1, round(steps / 10))
    c.data.eval_max_batches = args.curve_batches
    if args.vocab:
      c.data.vocab_size = args.vocab
  else:
    preset = common.PRESETS[args.preset]
    c = default.get_config()
    c.model.family = "gpt2"
    for key, value in preset["model"].items():
      if key != "vocab_size":
        c.model[key] = value
    c.seq_len = preset["seq_len"]
    c.model.max_len = max(c.model.max_len, c.seq_len)
    c.global_batch_size = c.eval_batch_size = preset["batch"]
    c.eval_every_steps = 0  # the benchmark scores the checkpoints itself
    c.optim.learning_rate = args.lr
    c.optim.b2 = args.b2
    c.data.eval_max_batches = 1  # the loop's own end-of-run eval: one batch
    c.data.vocab_size = args.vocab or preset["model"]["vocab_size"]
  c.seed = seed
  c.model.kind = kind
  if kind == "diffeqformer":
    c.model.train_time_grid = args.ode_grid
  c.num_train_steps = steps
  c.log_every_steps = args.log_every
  c.checkpoint_every_steps = args.checkpoint_every
  c.data.source = "local"
  c.data.train_files = os.path.join(os.path.abspath(args.data_dir), "train-*.txt")
  c.data.eval_files = os.path.join(os.path.abspath(args.data_dir), "valid.txt")
  c.data.cache_dir = os.path.join(root, "cache")  # one tokenizer for every run
  return c


def score(
  workdir: str,
  step: int,
  data_dir: str,
  max_batches: int,
  eval_texts: tuple = (),
  finer: tuple = (),
) -> dict:
  """Loss, perplexity and tokens of `workdir`'s checkpoint `step` on valid and test, under
  'texts' on each file of `eval_texts` (by its path), and under 'test_at' on test at each
  solver step count N of `finer` (an ODE model's other N, e.g. 2K and 4K)."""
  loaded = loading.load_model(workdir, step=step)
  files = {split: os.path.join(os.path.abspath(data_dir), f"{split}.txt") for split in SPLITS}
  files.update({("text", path): path for path in eval_texts})
  out = {"texts": {}} if eval_texts else {}
  for name, path in files.items():
    data = evaluation.eval_data(
      workdir, loaded.config, max_batches=max_batches, data="local:" + os.path.abspath(path)
    )
    r = evaluation.evaluate_model(loaded.model, data.batches(), None, loaded.rules)
    result = {"loss": r.loss, "perplexity": r.perplexity, "tokens": r.num_tokens}
    if isinstance(name, tuple):
      out["texts"][name[1]] = result
    else:
      out[name] = result
    if name == "test" and finer:
      out["test_at"] = {}
      for n in finer:
        r = evaluation.evaluate_model(loaded.model, data.batches(), n, loaded.rules)
        out["test_at"][str(n)] = {
          "loss": r.loss,
          "perplexity": r.perplexity,
          "tokens": r.num_tokens,
        }
  return out


def finer_steps(config, point: int, steps: int) -> tuple:
  """The other N a final DiffEqFormer checkpoint is scored at: 2K and 4K."""
  if point != steps or config.model.kind != "diffeqformer":
    return ()
  return (2 * config.model.solver_steps, 4 * config.model.solver_steps)


def run_points(
  args, kind: str, seed: int, steps: int, root: str, stop: int, text: TrainingText
) -> dict:
  """Trains one model up to each evaluation step (up to `stop`) and scores it there;
  returns {step: scores} with each score's 'note' (trained now / read back)."""
  config = make_config(args, kind, seed, steps, root)
  workdir = os.path.join(root, run_name(args, kind, seed, steps))
  evals_path = os.path.join(workdir, EVALS_FILE)
  stored = (common.read_json(evals_path) or {}) if common.is_current(config, workdir) else {}
  points = [s for s in range(args.eval_every, steps, args.eval_every)] + [steps]
  done = {}
  for point in (s for s in points if s <= stop):
    batches = args.eval_batches if point == steps else args.curve_batches
    texts = tuple(args.eval_texts) if point == steps else ()
    finer = finer_steps(config, point, steps)
    entry = stored.get(str(point))
    if (
      entry
      and entry["eval_batches"] == batches
      and sorted(entry.get("texts", {})) == sorted(texts)
      and sorted(entry.get("test_at", {})) == sorted(map(str, finer))
    ):
      entry = dict(entry, note=f"read back from {evals_path} (code {common.code_version()})")
    else:
      r, note = common.keyed_run(config, workdir, stop_at_step=point if point < steps else 0)
      if r["step"] < point:  # SIGTERM or Ctrl-C: saved, stopped
        raise UserError(
          f"{workdir} stopped at step {r['step']} (interrupted); fix: run the "
          "same command again to continue from its checkpoint"
        )
      if r["step"] > point:  # already past it, with its score lost
        print(
          f"seed {seed} step {point:>6} {kind:13s} | not scored: {workdir} is at step "
          f"{r['step']} and scores only the step it stops at",
          flush=True,
        )
        continue
      stored = common.read_json(evals_path) or {}  # empty when keyed_run moved a stale run aside
      entry = dict(
        score(workdir, point, args.data_dir, batches, texts, finer),
        eval_batches=batches,
        num_params=int(r["num_params"]),
        documents_read=text.documents_read(r["data_state"], seed),
      )
      stored[str(point)] = entry
      common.write_json(evals_path, stored)
      entry = dict(entry, note=note or "trained now")
    done[point] = entry
    print(
      f"seed {seed} step {point:>6} {kind:13s} | valid ppl "
      f"{entry['valid']['perplexity']:9.2f} | test ppl {entry['test']['perplexity']:9.2f} "
      f"| {entry['test']['tokens']:,} test tokens | {entry['note']}",
      flush=True,
    )
    if entry.get("test_at"):
      k_ppl = entry["test"]["perplexity"]
      print(
        f"seed {seed} step {point:>6} {kind:13s} | test ppl at other N: "
        + ", ".join(
          f"N={n} {v['perplexity']:.2f} ({v['perplexity'] / k_ppl:.3f} of K's)"
          for n, v in entry["test_at"].items()
        ),
        flush=True,
      )
  return done


def read_curve(workdir: str, tag: str = "eval/perplexity") -> dict:
  """{step: value} of one scalar the training loop wrote to WORKDIR/tensorboard: every
  events file in name (= creation time) order, a later value for a step replacing an
  earlier one (a resumed run writes a new file); a record cut short by a kill ends its
  file."""
  from tensorboardX.proto import event_pb2  # lazy: at the top it would import torch (metrics.py)

  out = {}
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i + 12 <= len(data):  # TFRecord: u64 length, u32 crc, data, u32 crc
      (n,) = struct.unpack("<Q", data[i : i + 8])
      if i + 16 + n > len(data):
        break
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 16 + n
      for value in event.summary.value:
        if value.tag == tag:
          out[int(event.step)] = float(value.simple_value)
  return out


def describe_device() -> str:
  devices = jax.devices()
  return f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"


def run_whole(args, kind: str, seed: int, steps: int, root: str, stop: int, text: TrainingText):
  """--config mode: one training call per run, the loop evaluating valid.txt every
  `eval_every_steps` (the learning curve, read back from its TensorBoard scalars); then
  the final checkpoint scored on the whole valid and test splits and each --eval_text.
  Returns the scores with 'curve' {step: valid perplexity}, 'train_seconds',
  'score_seconds', 'num_params', 'documents_read', 'device' and 'note'; None when
  --stop_after stopped the run first."""
  config = make_config(args, kind, seed, steps, root)
  workdir = os.path.join(root, run_name(args, kind, seed, steps))
  evals_path = os.path.join(workdir, EVALS_FILE)
  stored = (common.read_json(evals_path) or {}) if common.is_current(config, workdir) else {}
  entry = stored.get(str(steps))
  if (
    entry
    and entry["eval_batches"] == args.eval_batches
    and sorted(entry.get("texts", {})) == sorted(args.eval_texts)
  ):
    entry = dict(entry, note=f"read back from {evals_path} (code {common.code_version()})")
  else:
    start = time.perf_counter()
    r, note = common.keyed_run(config, workdir, stop_at_step=stop if stop < steps else 0)
    train_seconds = time.perf_counter() - start
    if r["step"] < steps:
      if r["step"] == stop:
        return None
      raise UserError(
        f"{workdir} stopped at step {r['step']} (interrupted); fix: run the "
        "same command again to continue from its checkpoint"
      )
    start = time.perf_counter()
    entry = score(workdir, steps, args.data_dir, args.eval_batches, tuple(args.eval_texts))
    entry.update(
      eval_batches=args.eval_batches,
      num_params=int(r["num_params"]),
      documents_read=text.documents_read(r["data_state"], seed),
      curve={str(k): v for k, v in sorted(read_curve(workdir).items())},
      train_seconds=train_seconds,
      score_seconds=time.perf_counter() - start,
      device=describe_device(),
      resumed_at=int(r["start_step"]),
    )
    stored = common.read_json(evals_path) or {}
    stored[str(steps)] = entry
    common.write_json(evals_path, stored)
    entry = dict(entry, note=note or "trained now")
  batches = f"{args.curve_batches} batches" if args.curve_batches else "whole split"
  for step, value in entry["curve"].items():
    print(
      f"seed {seed} step {int(step):>6} {kind:13s} | valid ppl {value:9.2f} "
      f"({batches}, the loop's evaluation)",
      flush=True,
    )
  part = f", from step {entry['resumed_at']}" if entry.get("resumed_at") else ""
  print(
    f"seed {seed} {kind:13s} | {steps} steps | valid ppl "
    f"{entry['valid']['perplexity']:9.2f} | test ppl {entry['test']['perplexity']:9.2f} "
    f"| {entry['test']['tokens']:,} test tokens | train {entry['train_seconds']:.1f} s"
    f"{part}, score {entry['score_seconds']:.1f} s on {entry['device']} | "
    f"{entry['note']}",
    flush=True,
  )
  return entry
