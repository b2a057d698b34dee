"""Training and evaluation metrics (clu.metrics), TensorBoard events and log lines.

TensorBoard events are written with tensorboardX, not clu.metric_writers: the latter
imports TensorFlow at import time, and TF would more than double
the virtualenv for nothing else. `clu.metrics` itself needs no TF
and is what the train and eval steps return. On an object store (`gs://` workdir) the
event file is written through `odetransformer.runtime.fileio` (`_ObjectEventFile`).

Metrics are averaged over the interval since the last write and then reset (not since
step 0): the loss is a token-weighted mean (sum of losses / sum of target weights).
"""

from collections.abc import Mapping
import functools
import math
import struct
import sys
import tempfile
import time
from typing import NamedTuple

from absl import logging
from clu import metrics as clu_metrics
import flax
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.errors import ConfigError
from odetransformer.runtime import fileio


@flax.struct.dataclass
class TokenAverage(clu_metrics.Average):
  """Average weighted by tokens: total = Σ per-token values, count = Σ weights.

  Subclasses pick their output keys with `sum_key` / `weight_key`; the train step
  hands the sums over, so the mean over an interval is exact whatever the padding.
  """

  sum_key = "loss_sum"
  weight_key = "weight_sum"

  @classmethod
  def from_model_output(cls, **outputs) -> "TokenAverage":
    total = jnp.asarray(outputs[cls.sum_key], jnp.float32)
    count = jnp.asarray(outputs[cls.weight_key], jnp.float32)
    return cls(total=total, count=count)


@flax.struct.dataclass
class TokenLoss(TokenAverage):
  sum_key = "loss_sum"


@flax.struct.dataclass
class TokenAccuracy(TokenAverage):
  sum_key = "correct_sum"


@flax.struct.dataclass
class AppliedStepAverage(TokenAverage):
  """Mean over the steps whose update was applied (a skipped step has weight 0)."""

  sum_key = "grad_norm"
  weight_key = "applied"


@flax.struct.dataclass
class SkippedSteps(clu_metrics.Metric):
  """How many steps were skipped for a non-finite loss or gradient (a sum, not a mean)."""

  total: jnp.ndarray

  @classmethod
  def from_model_output(cls, **outputs) -> "SkippedSteps":
    return cls(total=1 - jnp.asarray(outputs["applied"]).astype(jnp.int32))

  def merge(self, other: "SkippedSteps") -> "SkippedSteps":
    return type(self)(total=self.total + other.total)

  def compute(self):
    return self.total


@flax.struct.dataclass
class TrainMetrics(clu_metrics.Collection):
  """What one train step reports (merged on the host between log writes).

  Outputs: loss_sum and weight_sum (Σ token losses and target weights), grad_norm (before
  clipping), learning_rate and applied (1.0, or 0.0 for a skipped step, whose loss,
  weights and gradient norm are then passed as 0).
  """

  loss: TokenLoss
  grad_norm: AppliedStepAverage
  learning_rate: clu_metrics.LastValue.from_output("learning_rate")
  skipped_steps: SkippedSteps


@flax.struct.dataclass
class EvalMetrics(clu_metrics.Collection):
  loss: TokenLoss
  accuracy: TokenAccuracy


def summarize(computed: Mapping[str, float]) -> dict:
  """Floats from `Collection.compute()`, with perplexity added next to the loss."""
  out = {k: float(v) for k, v in computed.items()}
  if "loss" in out:
    out["perplexity"] = math.exp(min(out["loss"], 80.0)) if math.isfinite(out["loss"]) else math.nan
  return out


class _ObjectEventFile:
  """A TensorBoard event file on an object store, where objects cannot be appended to:
  each flush that has new events rewrites the object whole."""

  def __init__(self, path: str):
    self.path, self.data, self.flushed = path, bytearray(), 0

  def write(self, data: bytes):
    self.data += data

  def flush(self):
    if len(self.data) != self.flushed:
      fileio.write_bytes_atomic(self.path, bytes(self.data))
      self.flushed = len(self.data)

  def close(self):
    self.flush()


class _ObjectEventFiles:
  """tensorboardX's writer factory for a URL scheme (its own for gs:// bypasses fileio)."""

  def open(self, path):
    return _ObjectEventFile(path)

  def directory_check(self, path):
    pass  # an object store has no directories to create


def _import_tensorboardx():
  """tensorboardX, imported without PyTorch unless this process already has it.

  tensorboardX's writer imports torch whenever it is installed (to accept torch tensors):
  seconds of CPU at the start of every training or tool process in an environment with
  torch (the export extra, a GPU image), for event files that hold only floats and text.
  """
  if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
    sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
    try:
      import tensorboardX  # lazy, with torch blocked: the point of this function
    finally:
      del sys.modules["torch"]
  import tensorboardX.record_writer  # noqa: F401  lazy (above); callers use .record_writer

  return sys.modules["tensorboardX"]


class MetricWriter:
  """TensorBoard scalars/text (tensorboardX) on process 0; no-op elsewhere."""

  def __init__(self, logdir: str, enabled: bool | None = None):
    self.logdir = logdir
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    if self.enabled:
      tensorboardx = _import_tensorboardx()
      if not fileio.is_local(logdir):
        tensorboardx.record_writer.register_writer_factory(
          logdir.split("://")[0], _ObjectEventFiles()
        )
      self._writer = tensorboardx.SummaryWriter(logdir=logdir, flush_secs=30)

  def write_scalars(self, step: int, scalars: Mapping[str, float], prefix: str = ""):
    if self._writer is None:
      return
    for name, value in scalars.items():
      self._writer.add_scalar(f"{prefix}{name}", float(value), global_step=int(step))

  def write_text(self, step: int, tag: str, text: str):
    if self._writer is not None:
      # Markdown code block so TensorBoard keeps the layout.
      self._writer.add_text(tag, "```\n" + text + "\n```", global_step=int(step))

  def flush(self):
    if self._writer is not None:
      self._writer.flush()

  def close(self):
    if self._writer is not None:
      self._writer.close()
      self._writer = None


# Dense peak FLOP/s per accelerator, used for MFU: the bf16 dense peak (MFU is
# conventionally quoted against it even for f32 runs). Substrings of
# '<platform> <device_kind>' are matched in order. A CPU's peak is measured instead
# (`measured_matmul_flops`): no table entry could fit every host.
_PEAK_FLOPS = (
  ("TPU v6 lite", 918e12),
  ("TPU v6e", 918e12),
  ("TPU v5 lite", 197e12),
  ("TPU v5e", 197e12),
  ("TPU v5p", 459e12),
  ("TPU v5", 459e12),
  ("TPU v4", 275e12),
  ("TPU v3", 123e12),
  ("H200", 989e12),
  ("H100", 989e12),
  ("A100", 312e12),
  ("B200", 2250e12),
  ("L40S", 362e12),
  ("L4", 121e12),
  ("A10G", 70e12),
)


class PeakFlops(NamedTuple):
  """The MFU denominator of one device and where it came from (for the log)."""

  flops: float  # FLOP/s; 0.0 = unknown (MFU is not reported)
  source: str


@functools.cache
def measured_matmul_flops(
  device: jax.Device, dtype: str = "float32", n: int = 1024, reps: int = 3
) -> float:
  """FLOP/s of the fastest of `reps` n×n `dtype` matmuls on `device` (after one call
  that compiles), measured once per process and device: a fraction of a second. Runs
  on a mesh of `device` alone, whatever mesh the caller has set (a training run's)."""
  best = math.inf
  with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("device",))):
    x = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    for _ in range(reps):
      start = time.perf_counter()
      matmul(x).block_until_ready()
      best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def device_peak_flops(
  device: jax.Device | None = None, override: float = 0.0, dtype: str = "float32"
) -> PeakFlops:
  """The peak FLOP/s of one device that MFU divides by, for training and benchmarks alike.

  `override` > 0 (`--config.peak_flops_per_device`) wins; an accelerator's comes from
  the bf16 dense-peak table; a CPU's is measured (`measured_matmul_flops` in the run's
  compute `dtype`; XLA:CPU's devices share the host's cores, so this is the host's);
  an unknown accelerator gives 0 (no MFU).
  """
  if override and override > 0:
    return PeakFlops(float(override), "--config.peak_flops_per_device")
  device = device or jax.local_devices()[0]
  if device.platform == "cpu":
    dtype = jax.dtypes.canonicalize_dtype(dtype).name  # float64 only under x64
    return PeakFlops(
      measured_matmul_flops(device, dtype),
      f"measured: fastest of 3 {dtype} 1024x1024 matmuls on this host, once per process",
    )
  kind = f"{device.platform} {device.device_kind}"
  for key, value in _PEAK_FLOPS:
    if key.lower() in kind.lower():
      return PeakFlops(value, f"{device.device_kind}: bf16 dense peak")
  return PeakFlops(
    0.0, f"unknown device kind {device.device_kind!r}: no MFU; set --config.peak_flops_per_device"
  )


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
  """Throughput, MFU and ETA between log writes (the work clu's ReportProgress does).

  Args:
    num_train_steps: last step of the run.
    start_step: step the run starts (or resumes) from.
    tokens_per_step: tokens processed by one optimizer step, all devices together.
    flops_per_token: training FLOPs per token (forward + backward).
    peak_flops: peak FLOP/s of all devices together (0 disables MFU).
  """

  def __init__(
    self,
    num_train_steps: int,
    start_step: int,
    tokens_per_step: int,
    flops_per_token: float,
    peak_flops: float,
  ):
    self.num_train_steps = num_train_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops
    self._t0 = time.perf_counter()
    self._last_time = self._t0
    self._last_step = start_step
    self._steps_per_sec = math.nan

  def mark(self, step: int):
    """Restarts the interval (e.g. after compilation or evaluation)."""
    self._last_time = time.perf_counter()
    self._last_step = step

  def update(self, step: int) -> dict:
    """Rates since the previous update; call after the step's metrics are fetched."""
    now = time.perf_counter()
    dt = max(now - self._last_time, 1e-9)
    steps = step - self._last_step
    out = {"elapsed_s": now - self._t0}
    if steps > 0:
      self._steps_per_sec = steps / dt
      tokens_per_sec = self._steps_per_sec * self.tokens_per_step
      out["steps_per_sec"] = self._steps_per_sec
      out["tokens_per_sec"] = tokens_per_sec
      if self.peak_flops > 0 and self.flops_per_token > 0:
        out["mfu"] = tokens_per_sec * self.flops_per_token / self.peak_flops
    remaining = self.num_train_steps - step
    if self._steps_per_sec > 0:
      out["eta_s"] = remaining / self._steps_per_sec
    self._last_time, self._last_step = now, step
    return out


class ProfileWindow:
  """`profile_steps='a,b'`: a jax.profiler trace of train steps a+1 … b.

  Written under `<workdir>/tensorboard/plugins/profile/` (TensorBoard's Profile tab
  with tensorboard-plugin-profile; the .trace.json.gz opens in Perfetto). '' = off.
  A remote logdir (gs://) gets the trace written to a local temporary directory first
  and copied there when it stops.
  """

  def __init__(self, start: int = -1, stop: int = -1, logdir: str = ""):
    self.start, self.stop, self.logdir = start, stop, logdir
    self._local = ""  # where the trace is written (a copy is uploaded)

  @classmethod
  def parse(cls, spec: str, logdir: str = "") -> "ProfileWindow":
    """The window of `spec` ('' or 'a,b' with 0 <= a < b); a one-line error otherwise."""
    spec = str(spec or "").strip()
    if not spec:
      return cls()
    try:
      start, stop = (int(p) for p in spec.split(","))
    except ValueError:
      start = stop = -1
    if not 0 <= start < stop:
      raise ConfigError(
        f"profile_steps={spec!r} must be 'a,b' with 0 <= a < b (trace the "
        "steps after step a up to step b), or '' for no trace"
      )
    return cls(start, stop, logdir)

  def before(self, step: int):
    """Call before running the step that follows `step`."""
    if step == self.start:
      self._local = self.logdir
      if not fileio.is_local(self.logdir):
        self._local = tempfile.mkdtemp(prefix="odet_profile_")
      jax.profiler.start_trace(self._local)
      log(f"profiling steps {self.start + 1}-{self.stop} into {self.logdir}")

  def after(self, step: int, outputs):
    """Call after the step that made it `step`, with that step's outputs."""
    if step == self.stop and self.start >= 0:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      if self._local != self.logdir:
        fileio.copy_tree(self._local, self.logdir)
        fileio.rmtree(self._local)
      log(f"profile written under {self.logdir}/plugins/profile")


_TRAIN_FIELDS = (
  ("loss", lambda v: f"loss {v:.4f}"),
  ("perplexity", lambda v: f"ppl {v:.2f}"),
  ("learning_rate", lambda v: f"lr {v:.3e}"),
  ("grad_norm", lambda v: f"grad_norm {v:.3f}"),
  ("skipped_steps", lambda v: f"skipped {int(v)} non-finite steps"),
  ("tokens_per_sec", lambda v: f"tok/s {v:,.0f}"),
  ("mfu", lambda v: f"MFU {100 * v:.1f}%"),
  ("eta_s", lambda v: f"ETA {format_duration(v)}"),
)


def train_log_line(step: int, num_train_steps: int, scalars: Mapping[str, float]) -> str:
  """One human line: step, loss, perplexity, lr, grad norm, tokens/s, MFU, ETA (and the
  steps skipped since the last line, when there were any)."""
  parts = [f"step {step}/{num_train_steps}"]
  parts += [
    show(scalars[key])
    for key, show in _TRAIN_FIELDS
    if key in scalars and (key != "skipped_steps" or scalars[key])
  ]
  return " | ".join(parts)


def eval_log_line(step: int, scalars: Mapping[str, float]) -> str:
  parts = [f"eval @ step {step}"]
  for key, fmt in (("loss", ".4f"), ("perplexity", ".2f"), ("accuracy", ".4f")):
    if key in scalars:
      parts.append(f"{key} {scalars[key]:{fmt}}")
  if "num_tokens" in scalars:
    parts.append(f"tokens {int(scalars['num_tokens']):,}")
  return " | ".join(parts)


def log(line: str):
  """Log lines from process 0 only."""
  if jax.process_index() == 0:
    logging.info("%s", line)


def read_scalars(logdir: str) -> dict:
  """{tag: [(step, value), ...]} from the TensorBoard event files in `logdir`.

  A reader that needs neither TensorFlow nor the tensorboard package: event files
  are TFRecords (8-byte length, 4-byte crc, payload, 4-byte crc) of Event protos.
  """
  _import_tensorboardx()
  from tensorboardX.proto import event_pb2  # lazy: tensorboardX without torch (above)

  out = {}
  for name in fileio.listdir(logdir):
    if not name.startswith("events.out.tfevents."):
      continue
    data = fileio.read_bytes(fileio.join(logdir, name))
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      payload = data[pos + 12 : pos + 12 + length]
      pos += 12 + length + 4
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        if value.HasField("simple_value"):
          out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out
