"""Shared set-up for benchmarks: presets, the product's own train step on a mesh, and
training runs reused only by the code and config that made them.

Benchmarks time exactly what `main.py` runs: `steps.init_train_state` and
`steps.make_train_step` (donated, sharding-constrained, AdamW with clipping), with the
optimizer and mesh settings of `configs/default.py`.

A benchmark that keeps its training runs in a workdir (to continue after an
interruption, or to print its table again) trains them through `keyed_run`: each run's
workdir records `run_key` — the version of the code (`code_version`, a hash of the
sources) and the whole config — and is reused only under the same key; a run made by
other code or another config is moved aside and trained afresh, and every reused
result says so in the benchmark's output.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import statistics
import sys
import time

from odetransformer.runtime import hugepages

# As main.py does (with ODET_HUGEPAGES=1 on a CPU host), before jax is imported; only when
# a benchmark is the program (`python -m benchmarks.NAME`): importing this module from a
# notebook or test must not replace that process.
if getattr(sys.modules["__main__"].__spec__, "name", "").startswith("benchmarks."):
  hugepages.reexec_with_huge_pages()

# The rest after that re-exec (hence noqa: E402).
from flax import nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import default as default_config  # noqa: E402
from odetransformer import errors  # noqa: E402
from odetransformer.model.config import ModelConfig  # noqa: E402
from odetransformer.train import loop, optimizer, sharding, steps  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The source trees whose code computes a benchmark's runs and scores.
CODE_TREES = ("odetransformer", "input_pipeline", "configs", "benchmarks")
RUN_KEY_FILE = "benchmark_run_key.json"

# GPT-2 small's shape (vocab padded to a multiple of 128); the presets set d_t.
_GPT2_SMALL = dict(
  vocab_size=50304,
  d_model=768,
  num_heads=12,
  mlp_dim=3072,
  solver_steps=12,
  num_layers=12,
  max_len=1024,
  time_sinusoids=128,
)

PRESETS = {
  # vocab, d_model, heads, mlp, K = L, seq, batch, d_t, S
  "bench-small": dict(
    model=dict(
      vocab_size=8192,
      d_model=256,
      num_heads=4,
      mlp_dim=1024,
      solver_steps=6,
      num_layers=6,
      max_len=1024,
      time_embed_dim=64,
      time_sinusoids=64,
    ),
    seq_len=256,
    batch=8,
  ),
  "gpt2-small": dict(model=dict(_GPT2_SMALL, time_embed_dim=96), seq_len=256, batch=4),
  # The authors' GPT-2 small (configs/owt_small.py): d_t 20, S 128. Dropout off, as in
  # nanoGPT's speed runs. `throughput --nanogpt` compares at this shape, batch 16 × 1024.
  "owt-small": dict(model=dict(_GPT2_SMALL, time_embed_dim=20), seq_len=1024, batch=16),
  # Seconds, not a measurement: the tests run every benchmark end to end at this size.
  "tiny": dict(
    model=dict(
      vocab_size=512,
      d_model=32,
      num_heads=2,
      mlp_dim=64,
      solver_steps=2,
      num_layers=2,
      max_len=64,
      time_embed_dim=8,
      time_sinusoids=8,
    ),
    seq_len=32,
    batch=2,
  ),
}


def define_common_flags(define, remat: str = "dots_saveable") -> None:
  """The flags every model benchmark shares (`define` as `cli_flags.parse_flags` passes it);
  `remat` is the default of --remat."""
  define("enum", "preset", "bench-small", "Model and shape preset.", enum_values=sorted(PRESETS))
  define("enum", "dtype", "float32", "Compute dtype.", enum_values=["float32", "bfloat16"])
  define("integer", "seq_len", 0, "0 = the preset's")
  define("integer", "batch", 0, "0 = the preset's")
  define("string", "remat", remat, "remat policy for both models (same for both)")


def model_config(args, kind: str, **overrides) -> ModelConfig:
  preset = PRESETS[args.preset]
  fields = dict(preset["model"], kind=kind, dtype=args.dtype, remat_policy=args.remat)
  fields.update(overrides)
  return ModelConfig(**fields)


def shape(args):
  preset = PRESETS[args.preset]
  return (args.batch or preset["batch"]), (args.seq_len or preset["seq_len"])


class Trainer:
  """The product's train step for one model config on all local devices."""

  def __init__(
    self,
    cfg: ModelConfig,
    num_train_steps: int = 1000,
    seed: int = 0,
    allocate: bool = True,
    devices=None,
  ):
    """`allocate=False`: the state stays abstract (shapes and shardings), for `lower`
    only: nothing is initialised or placed on the devices. `devices`: the mesh's
    (default all of jax's; a compile-only topology's for `benchmarks.gpu_compile`)."""
    config = default_config.get_config()
    self.cfg = cfg
    self.mesh = sharding.make_mesh(config.mesh, devices)
    self.rules = sharding.logical_axis_rules(config.mesh.rules)
    tx = optimizer.create_optimizer(config.optim, num_train_steps, ode=cfg.is_ode)
    schedule = optimizer.learning_rate_schedule(config.optim, num_train_steps)
    with nnx.logical_axis_rules(self.rules):
      if allocate:
        self.ts, self.state = steps.init_train_state(cfg, tx, seed, self.mesh)
      else:
        self.ts = steps.state_layout(cfg, tx, seed, self.mesh)
        self.state = self.ts.abstract
    self.step_fn = steps.make_train_step(self.ts, schedule, self.rules)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.rng = jax.random.key(seed)

  def batch(self, b: int, length: int, seed: int = 0, packed: bool = False):
    """Random tokens [b, length]: one document a row (no segment ids: causal attention,
    as nanoGPT trains), or `packed` documents as the input pipeline makes them
    (segment ids, positions from 0 in each: `PACKED_DOCUMENTS` a row, lengths drawn)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, self.cfg.vocab_size, (b, length + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions}
    if packed:
      host["segment_ids"], host["positions"] = packed_rows(rng, b, length)
    host["weights"] = np.ones((b, length), np.float32)
    return jax.device_put(host, self.batch_sharding)

  def step(self, batch):
    with jax.set_mesh(self.mesh):
      self.state, metrics = self.step_fn(self.state, batch, self.rng)
    return metrics

  def lower(self, batch, rng=None):
    """The lowered (not yet compiled) train step, for memory/size analysis (`batch` and
    `rng` may be ShapeDtypeStructs)."""
    jitted = self.step_fn.__wrapped__
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(sharding.activation_rules(self.rules)):
      return jitted.lower(self.state, batch, self.rng if rng is None else rng)


PACKED_DOCUMENTS = 4  # documents a packed row holds in `Trainer.batch(..., packed=True)`


def packed_rows(rng, b: int, length: int):
  """(segment ids 1…n, positions restarting at 0 in each document) [b, length] of rows
  holding PACKED_DOCUMENTS documents each, cut at random points."""
  segment_ids = np.zeros((b, length), np.int32)
  positions = np.zeros((b, length), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, length), PACKED_DOCUMENTS - 1, replace=False))
    for i, (start, end) in enumerate(zip([0, *cuts], [*cuts, length])):
      segment_ids[row, start:end] = i + 1
      positions[row, start:end] = np.arange(end - start)
  return segment_ids, positions


def block(tree):
  jax.tree.map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)
  return tree


def time_rounds(fns: dict, rounds: int, warmup: int = 1) -> dict:
  """Seconds per call of each fn in each round, calling them in turn (fair under load)."""
  for _ in range(warmup):
    for fn in fns.values():
      block(fn())
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      block(fn())
      times[name].append(time.perf_counter() - start)
  return times


def time_alternating(fns: dict, rounds: int, warmup: int = 1) -> dict:
  """Median seconds per call of each fn, calling them in turn (fair under load)."""
  return {name: statistics.median(ts) for name, ts in time_rounds(fns, rounds, warmup).items()}


def paired_spread(num: list, den: list) -> str:
  """Quartiles of num[i] / den[i] over rounds: how much a ratio moves on this machine."""
  ratios = sorted(a / b for a, b in zip(num, den))
  if len(ratios) < 2:
    return f"{ratios[0]:.2f} (1 round)"
  q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
  return (
    f"median {q2:.2f}, quartiles {q1:.2f}–{q3:.2f}, range {ratios[0]:.2f}–"
    f"{ratios[-1]:.2f} over {len(ratios)} rounds"
  )


def replace(cfg: ModelConfig, **kw) -> ModelConfig:
  return dataclasses.replace(cfg, **kw)


@functools.cache
def code_version(root: str = str(REPO_ROOT)) -> str:
  """12 hex digits of a sha256 over every .py file of `CODE_TREES` under `root` (its path
  and bytes): the same sources give the same version, with or without git, and any edit
  (committed or not) another."""
  digest = hashlib.sha256()
  for tree in CODE_TREES:
    for path in sorted(pathlib.Path(root, tree).rglob("*.py")):
      digest.update(path.relative_to(root).as_posix().encode() + b"\0")
      digest.update(path.read_bytes() + b"\0")
  return digest.hexdigest()[:12]


def read_json(path: str):
  """The JSON value in file `path`; None when it is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_json(path: str, value) -> None:
  """Writes `value` as JSON to `path` atomically (a temporary file, then a rename)."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


def _read_key(workdir: str):
  return read_json(os.path.join(workdir, RUN_KEY_FILE))


def run_key(config) -> dict:
  """What a run's results depend on: the code version, the whole config and, for a
  fine-tuning run, the key of the run it starts from (`init_from`)."""
  key = {"code": code_version(), "config": json.loads(config.to_json_best_effort(sort_keys=True))}
  if config.get("init_from"):
    key["init_from"] = _read_key(config.init_from)
  return key


def is_current(config, workdir: str) -> bool:
  """Whether `workdir` holds a run of this code and config (`keyed_run` would reuse it)."""
  return _read_key(workdir) == run_key(config)


def _move_aside(workdir: str, old) -> str:
  """Renames a workdir made under another key to `<workdir>.stale-<its code>[-i]`."""
  base = f"{workdir}.stale-{(old or {}).get('code', 'unkeyed')}"
  dest, i = base, 1
  while os.path.exists(dest):
    dest, i = f"{base}-{i}", i + 1
  os.rename(workdir, dest)
  return dest


def keyed_run(config, workdir: str, stop_at_step: int = 0) -> tuple:
  """`loop.train_and_evaluate(config, workdir, stop_at_step)`, reusing what `workdir`
  holds only when its recorded `run_key` is this one's.

  A non-empty workdir with another key (other code or config, or none recorded) is
  moved aside (nothing is deleted; a line says where) and the run trains afresh. With
  the same key the run resumes from its checkpoints (a finished run only evaluates).
  Returns (result, note): note '' when every step was trained now, else where the steps
  were read back from, naming the workdir and the code version. A run that SIGTERM or
  Ctrl-C stopped (its checkpoint saved) ends the benchmark with a line and exit status
  75 (`errors.EXIT_STOPPED_EARLY`), as main.py does: a part-trained run is never scored.
  """
  key = run_key(config)
  if os.path.isdir(workdir) and os.listdir(workdir):
    old = _read_key(workdir)
    if old != key:
      why = (
        "no run key"
        if old is None
        else f"code {old.get('code')}"
        if old.get("code") != key["code"]
        else "another config"
      )
      print(
        f"{workdir} was made under {why}: moved to {_move_aside(workdir, old)}, "
        f"training afresh (code {key['code']})",
        flush=True,
      )
  os.makedirs(workdir, exist_ok=True)
  write_json(os.path.join(workdir, RUN_KEY_FILE), key)
  result = loop.train_and_evaluate(config, workdir, stop_at_step=stop_at_step)
  start, step = int(result["start_step"]), int(result["step"])
  if result.get("preempted"):  # a part-trained run is not a result: stop, resumable
    print(
      f"{workdir}: stopped at step {step} of {config.num_train_steps} (SIGTERM or Ctrl-C), "
      "its checkpoint saved; the same command resumes it",
      flush=True,
    )
    sys.exit(errors.EXIT_STOPPED_EARLY)
  if start == 0:
    return result, ""
  if start == step:
    return result, f"read back from {workdir} (code {key['code']}, trained earlier: {step} steps)"
  return result, (f"resumed at step {start} of {step} from {workdir} (code {key['code']})")
