"""The train step compiled for an H100 on this CPU (`benchmarks.gpu_compile`): its byte
counting against closed forms, and a budget that keeps the step from falling back.

XLA compiles for a GPU from a target description alone; that needs the CUDA plugin and
cuDNN (requirements-compile.txt), which CI installs. Without them these tests skip,
saying so; with ODET_REQUIRE_GPU_COMPILE=1 (CI) they fail instead.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
from jax._src import config as jax_config
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.gpu_compile import hlo_bytes
from odetransformer.model import blocks
from odetransformer.tools import compile_targets
from odetransformer.train import losses, steps

pytestmark = pytest.mark.slow

HAVE_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None
if not HAVE_PLUGIN:
  if os.environ.get("ODET_REQUIRE_GPU_COMPILE") == "1":
    raise RuntimeError("ODET_REQUIRE_GPU_COMPILE=1 but jax_cuda12_plugin is not installed")
  pytestmark = [
    pytestmark,
    pytest.mark.skip(reason="no CUDA compiler: pip install -r requirements-compile.txt"),
  ]

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = compile_targets.H100_TARGET


def h100_devices():
  from jax.experimental import topologies  # lazy: only with the plugin

  return topologies.get_topology_desc(
    platform="cuda", topology="1x1x1", target_config=TARGET.read_text()
  ).devices


def compile_for_h100(fn, *shapes):
  """Optimized HLO text of `fn` compiled for one H100 (inputs: (shape, dtype) pairs)."""
  mesh = jax.sharding.Mesh(h100_devices(), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  structs = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in shapes]
  # Never written to the tests' compilation cache: a compile-only executable cannot be
  # loaded back (jax warns on reading one). Under the mesh: the model and loss pick their
  # GPU paths from its devices.
  with jax_config.persistent_cache_min_compile_time_secs(1e9), jax.set_mesh(mesh):
    return jax.jit(fn).lower(*structs).compile().as_text()


def test_a_scan_counts_its_body_times_its_trips():
  """K steps that each read one [n] row of a stacked [K, n] array and add it to a
  carry: every step reads its row and the carry and writes the carry, K times."""
  k, n = 7, 1 << 20

  def f(stack, x):
    return jax.lax.scan(lambda c, row: (c * 2 + row, None), x, stack)[0]

  text = compile_for_h100(f, ((k, n), jnp.float32), ((n,), jnp.float32))
  module = hlo_bytes.parse_module(text)
  kernels, _ = hlo_bytes.kernels(module)
  in_loop = [kr for kr in kernels if kr.runs == k]
  step_bytes = sum(kr.total for kr in in_loop)
  # Per step at least the row, the carry read and the carry written (3·4n bytes); a
  # loop that charged the whole stack each step would count K·4n more.
  assert 3 * 4 * n * k <= step_bytes <= 3 * 4 * n * k + 4 * n * k // 2, in_loop


def test_a_gather_counts_the_rows_it_reads():
  """Rows of a [V, d] table picked by [b] indices: b·d elements read, b·d written."""
  v, d, b = 50304, 768, 64

  def f(table, idx):
    return jnp.take(table, idx, axis=0) * 2

  text = compile_for_h100(f, ((v, d), jnp.float32), ((b,), jnp.int32))
  module = hlo_bytes.parse_module(text)
  total = sum(kr.total for kr in hlo_bytes.kernels(module)[0])
  assert total == pytest.approx(2 * 4 * b * d + 4 * b, rel=0.05)


def test_a_matmul_counts_operands_result_and_flops():
  m, k, n = 1024, 768, 3072

  def f(a, w):
    return a @ w

  text = compile_for_h100(f, ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16))
  kernels, flops = hlo_bytes.kernels(hlo_bytes.parse_module(text))
  assert flops == 2 * m * k * n
  assert sum(kr.total for kr in kernels) == 2 * (m * k + k * n + m * n)


def test_the_loss_backward_keeps_float32_inside_its_fusions():
  """bfloat16 logits: the gradient's program holds no float32 [b, l, vocab] buffer and
  no scatter (d logits is written once, in bfloat16), and reads the logits once in the
  forward (one pass for the log-sum-exp)."""
  b, length, vocab = 4, 256, 8192

  def f(logits, targets, weights):
    return jax.grad(lambda x: losses.token_cross_entropy(x, targets, weights)[0])(logits)

  text = compile_for_h100(
    f, ((b, length, vocab), jnp.bfloat16), ((b, length), jnp.int32), ((b, length), jnp.float32)
  )
  module = hlo_bytes.parse_module(text)
  entry = module.computations[module.entry]
  assert not [i.name for i in entry if f"f32[{b},{length},{vocab}]" in i.shape]
  assert "scatter" not in text
  total = sum(kr.total for kr in hlo_bytes.kernels(module)[0])
  logits_bytes = 2 * b * length * vocab
  # forward: one read; backward: one read and one write (plus [b, l] vectors).
  assert total <= 3 * logits_bytes * 1.02


def test_unpacked_rows_reach_cudnn_as_plain_causal_attention():
  q = ((2, 256, 4, 64), jnp.bfloat16)

  def f(q, k, v):
    return blocks.dot_product_attention(q, k, v, None, "cudnn")

  module = hlo_bytes.parse_module(compile_for_h100(f, q, q, q))
  assert hlo_bytes.attention_kernels(module) == ["cudnn causal"]


# Per-step budgets of bench-small (d 256, 4 heads, K = L = 6, d_t 64, seq 256, batch 8,
# vocab 8192; bf16, remat none, unpacked rows): 5 device copies each, 723,136 and
# 1,784,884 bytes a token when set, with 1.5% headroom (the count is deterministic). Each
# fused backward switched back to autodiff alone goes over the GPT's, as measured: the
# loss 805,080, GELU 747,712, the norms 738,428; a scan's copies go over the copies.
BUDGETS = {
  "transformer": {"copies": 8, "bytes_per_token": 734_000},
  "diffeqformer": {"copies": 8, "bytes_per_token": 1_812_000},
}


def test_the_train_step_stays_within_its_budget(tmp_path):
  out = tmp_path / "figures.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.gpu_compile",
      "--preset=bench-small",
      "--dtype=bfloat16",
      "--remat=none",
      f"--json={out}",
    ],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  figures = json.loads(out.read_text())
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("h100 train step (bench-small, bf16, 8 x 256): transformer ")
  for kind, budget in BUDGETS.items():
    f = figures[kind]
    assert f["attention"] == ["cudnn causal"], (kind, f["attention"])
    assert f["counts"]["copies"] <= budget["copies"], (kind, f["counts"])
    assert f["bytes_per_token"] <= budget["bytes_per_token"], (kind, f["bytes_per_token"])
    assert np.isfinite(f["temp"]) and f["temp"] > 0


def test_the_gpu_option_keeps_matmuls_that_share_an_operand_apart():
  """`steps.GPU_TRAIN_STEP_OPTIONS`: two matmuls of one x stay two GEMMs, with no
  concatenated weight written for one merged GEMM (XLA's default merges them)."""
  m, d = 4096, 768

  def f(x, w1, w2):
    return (x @ w1).sum() + (x @ w2).sum()

  shapes = (((m, d), jnp.bfloat16), ((d, d), jnp.bfloat16), ((d, d), jnp.bfloat16))

  def gemms_and_concats(options):
    mesh = jax.sharding.Mesh(h100_devices(), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    structs = [jax.ShapeDtypeStruct(s, t, sharding=rep) for s, t in shapes]
    with jax_config.persistent_cache_min_compile_time_secs(1e9):
      text = jax.jit(f, compiler_options=options).lower(*structs).compile().as_text()
    module = hlo_bytes.parse_module(text)
    insts = [i for c in module.computations.values() for i in c]
    gemms = [i for i in insts if i.opcode == "dot" or "cublas" in i.target]
    return len(gemms), any(i.opcode == "concatenate" for i in insts)

  assert gemms_and_concats(None) == (1, True)  # XLA's dot merger
  assert gemms_and_concats(steps.GPU_TRAIN_STEP_OPTIONS) == (2, False)
