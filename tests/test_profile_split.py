"""benchmarks.throughput.profile_split: a trace's device ops summed by kind, against
hand-made traces whose answer is known, and against a real XLA:CPU trace of a known
program."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.throughput import profile_split


def _meta(pid, name):
  return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def _op(name, ts, dur, pid=1, tid=1, **args):
  return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_gpu_trace_by_kind_with_overlapping_streams():
  """Two steps on a GPU: kernels on two streams overlap; host events are ignored."""
  events = [_meta(1, "/device:GPU:0"), _meta(2, "/host:CPU")]
  for t0 in (0, 1000):
    events += [
      _op("sm90_xmma_gemm_bf16bf16", t0, 300, hlo_op="custom-call.3"),
      _op("cudnn_generated_fort_native_sdpa_sm90", t0 + 300, 100, hlo_op="custom-call.7"),
      _op("loop_add_fusion", t0 + 400, 200, hlo_op="add_fusion.2"),
      _op(
        "MemcpyDtoD",
        t0 + 450,
        100,
        tid=2,  # overlaps the fusion
        memcpy_details="kind_src:device kind_dst:device size:2097152 dest:0",
      ),
      _op(
        "MemcpyDtoD",
        t0 + 600,
        10,
        tid=2,
        memcpy_details="kind_src:device kind_dst:device size:4096 dest:0",
      ),
      _op("PjitFunction(step)", t0, 900, pid=2, hlo_op="ignored.1"),  # host side
    ]
  s = profile_split.split(events, steps=2, wall_s=1e-3)
  assert s["matmul"] == pytest.approx(300e-6)
  assert s["attention"] == pytest.approx(100e-6)
  assert s["other fusions"] == pytest.approx(200e-6)
  assert s["copies"] == pytest.approx(110e-6)
  assert (s["copies_count"], s["big_copies_count"]) == (2, 1)
  assert s["busy"] == pytest.approx(610e-6)  # 0..610 µs: the overlap counted once
  assert s["idle"] == pytest.approx(1e-3 - 610e-6)
  assert s["top"][0] == ("custom-call.3", pytest.approx(300e-6))


def test_cpu_trace_counts_leaves_not_their_enclosing_loops():
  """On XLA:CPU a `while` thunk's event encloses its body's ops on the same thread."""
  events = [
    _meta(1, "/host:CPU"),
    _op("while", 0, 100, hlo_op="while.3"),
    _op("ynn_fusion", 10, 30, hlo_op="ynn_fusion.1"),
    _op("fusion", 50, 40, hlo_op="multiply_add_fusion"),
    _op("copy", 95, 5, hlo_op="copy.2"),
    _op("fusion", 0, 60, tid=2, hlo_op="exponential_fusion"),  # another thread
    _op("PjitFunction(step)", 0, 100),
  ]  # no hlo_op: host
  assert sorted(e["args"]["hlo_op"] for e in profile_split.device_ops(events)) == [
    "copy.2",
    "exponential_fusion",
    "multiply_add_fusion",
    "ynn_fusion.1",
  ]
  s = profile_split.split(events, steps=1, wall_s=200e-6)
  assert s["matmul"] == pytest.approx(30e-6)
  assert s["other fusions"] == pytest.approx(100e-6)
  assert s["copies"] == pytest.approx(5e-6)
  assert s["busy"] == pytest.approx(95e-6)  # 10..40, 50..90, 95..100 ∪ the other's 0..60
  assert s["idle"] == pytest.approx(105e-6)


def test_a_real_cpu_trace_finds_the_programs_matmul(tmp_path):
  """A jitted program that is one large matmul: its time is the matmul's."""
  a = jnp.ones((512, 512), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  events, wall = profile_split.trace(lambda: f(a), steps=3, logdir=str(tmp_path))
  s = profile_split.split(events, 3, wall)
  assert s["matmul"] > 0
  assert s["matmul"] >= 0.5 * (s["matmul"] + s["other fusions"] + s["copies"])
  assert 0 < s["busy"] <= wall * 1.001
  lines = profile_split.format_split("x", s)
  assert lines[0].startswith("profile x: step ") and " | idle " in lines[0]
