"""Token-weighted metrics, log lines, TensorBoard events and the checkpoint round trip."""

import functools
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import types

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from odetransformer.train import metrics
from odetransformer.train.checkpoint.manager import Checkpointer

from tiny import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _step_metrics(loss_sum, weight_sum, grad_norm, lr, applied=1.0):
  return metrics.TrainMetrics.single_from_model_output(
    loss_sum=jnp.float32(loss_sum),
    weight_sum=jnp.float32(weight_sum),
    grad_norm=grad_norm,
    learning_rate=lr,
    applied=jnp.float32(applied),
  )


def test_token_average_is_weighted_by_tokens():
  a = _step_metrics(10.0, 5.0, 1.0, 1e-3)
  b = _step_metrics(2.0, 1.0, 3.0, 2e-3)
  out = metrics.summarize(a.merge(b).compute())
  assert out["loss"] == pytest.approx(12.0 / 6.0)  # not (2 + 2) / 2
  assert out["perplexity"] == pytest.approx(math.exp(2.0))
  assert out["grad_norm"] == pytest.approx(2.0)
  assert out["learning_rate"] == pytest.approx(2e-3)  # last value
  assert out["skipped_steps"] == 0


def test_skipped_steps_are_counted_and_left_out_of_the_means():
  """A skipped step (the train step passes 0 for its sums) adds to skipped_steps only."""
  a = _step_metrics(10.0, 5.0, 1.0, 1e-3)
  skipped = _step_metrics(0.0, 0.0, 0.0, 1.5e-3, applied=0.0)
  b = _step_metrics(2.0, 1.0, 3.0, 2e-3)
  out = metrics.summarize(a.merge(skipped).merge(b).merge(skipped).compute())
  assert out["loss"] == pytest.approx(2.0)
  assert out["grad_norm"] == pytest.approx(2.0)  # (1 + 3) / 2, not / 4
  assert out["skipped_steps"] == 2
  line = metrics.train_log_line(4, 10, out)
  assert "skipped 2 non-finite steps" in line, line
  assert "skipped" not in metrics.train_log_line(4, 10, dict(out, skipped_steps=0.0))


def test_log_line_has_the_fields():
  line = metrics.train_log_line(
    50,
    100,
    {
      "loss": 2.0,
      "perplexity": 7.39,
      "learning_rate": 1e-3,
      "grad_norm": 0.5,
      "tokens_per_sec": 12345.0,
      "mfu": 0.123,
      "eta_s": 3725,
    },
  )
  for part in (
    "step 50/100",
    "loss 2.0000",
    "ppl 7.39",
    "lr 1.000e-03",
    "grad_norm 0.500",
    "tok/s 12,345",
    "MFU 12.3%",
    "ETA 1:02:05",
  ):
    assert part in line, (part, line)


def test_progress_rates_and_peak_lookup():
  p = metrics.Progress(
    num_train_steps=100, start_step=0, tokens_per_step=1000, flops_per_token=6.0, peak_flops=6000.0
  )
  p._last_time -= 2.0  # pretend 2 s passed for 10 steps
  out = p.update(10)
  assert out["tokens_per_sec"] == pytest.approx(5000, rel=0.05)
  assert out["mfu"] == pytest.approx(5.0, rel=0.05)
  assert out["eta_s"] == pytest.approx(18.0, rel=0.05)


def test_one_peak_definition_table_measured_or_override(monkeypatch):
  """Accelerators from the table, a CPU measured once per process (the same value again,
  no second measurement), an override wins, an unknown kind gives no MFU."""
  calls = []
  real = metrics.measured_matmul_flops.__wrapped__
  monkeypatch.setattr(
    metrics, "measured_matmul_flops", functools.lru_cache()(lambda *a: calls.append(a) or real(*a))
  )
  cpu = jax.local_devices()[0]
  first = metrics.device_peak_flops(dtype="bfloat16")
  assert first.flops > 0 and first.source.startswith("measured: fastest of 3 bfloat16 ")
  assert metrics.device_peak_flops(dtype="bfloat16") == first and calls == [(cpu, "bfloat16")]
  assert metrics.device_peak_flops(override=5.0) == (5.0, "--config.peak_flops_per_device")
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert metrics.device_peak_flops(h100) == (989e12, "NVIDIA H100 80GB HBM3: bf16 dense peak")
  odd = types.SimpleNamespace(platform="gpu", device_kind="Quantum 9000")
  assert metrics.device_peak_flops(odd).flops == 0.0
  assert len(calls) == 1


def test_measured_peak_is_the_fastest_matmul(monkeypatch):
  """2·n³ FLOPs over the fastest of the timed calls (the compiling call is not timed)."""
  clock = iter([10.0, 10.5, 11.0, 11.25, 12.0, 13.0])  # calls of 0.5, 0.25 and 1 s
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
  flops = metrics.measured_matmul_flops.__wrapped__(jax.local_devices()[0], "float32", 64, 3)
  assert flops == 2 * 64**3 / 0.25


def test_tensorboard_events_round_trip(tmp_path):
  w = metrics.MetricWriter(str(tmp_path), enabled=True)
  w.write_scalars(1, {"loss": 3.0}, prefix="train/")
  w.write_scalars(2, {"loss": 2.5}, prefix="train/")
  w.write_text(0, "config", "{}")
  w.close()
  assert metrics.read_scalars(str(tmp_path)) == {"train/loss": [(1, 3.0), (2, 2.5)]}


@pytest.mark.slow
def test_event_writer_leaves_torch_unimported_and_works_beside_it(tmp_path):
  """In a fresh process (as main.py) writing events does not import PyTorch, though the
  export extra installs it (tensorboardX's writer imports it: seconds of CPU); a
  process that imports torch afterwards, or had it before, still writes and reads."""
  if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed (requirements-export.txt)")
  script = f"""
import sys
from odetransformer.train import metrics
for i, logdir in enumerate(({str(tmp_path / "a")!r}, {str(tmp_path / "b")!r})):
  w = metrics.MetricWriter(logdir, enabled=True)
  w.write_scalars(1, {{"loss": 3.0 + i}})
  w.close()
  assert metrics.read_scalars(logdir) == {{"loss": [(1, 3.0 + i)]}}, logdir
  if i == 0:
    assert "torch" not in sys.modules, "torch was imported"
    import torch
print("ok")
"""
  proc = subprocess.run(
    [sys.executable, "-c", script],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-2000:]


class _Tiny(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.LayerNorm(4, rngs=rngs)


def test_checkpointer_round_trip_on_a_plain_module(tmp_path):
  model = _Tiny(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  opt.update(model, grads)
  # A grain-like state with a tuple that JSON turns into a list.
  data_state = {"remainder_slices": {"tokens": [-1, -1]}, "n": 7}
  ck = Checkpointer(str(tmp_path), max_to_keep=2)
  for step in (1, 2, 3):
    ck.save(step, model, opt, meta={"rng_key": [0, 42]}, data_state=data_state)
  ck.wait_until_finished()
  assert ck.all_steps() == [2, 3] and ck.latest_step() == 3

  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  _, abs_model = nnx.get_abstract_model(lambda: _Tiny(nnx.Rngs(1)), mesh)
  _, abs_opt = nnx.get_abstract_model(
    lambda: nnx.Optimizer(_Tiny(nnx.Rngs(1)), optax.adamw(1e-2), wrt=nnx.Param), mesh
  )
  m_state, o_state, meta, data = ck.restore(3, abs_model, abs_opt)
  ck.close()
  jax.tree.map(
    np.testing.assert_array_equal, nnx.to_pure_dict(m_state), nnx.to_pure_dict(nnx.state(model))
  )
  jax.tree.map(
    np.testing.assert_array_equal, nnx.to_pure_dict(o_state), nnx.to_pure_dict(nnx.state(opt))
  )
  assert int(o_state["step"][...]) == 1
  assert meta["step"] == 3 and meta["rng_key"] == [0, 42]
  assert data == json.loads(json.dumps(data_state))
