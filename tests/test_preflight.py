"""The pre-flight: the train step compiled for a TPU slice or an H100 cluster on this CPU
(`python -m odetransformer.memory --compile_for`), its HLO reader, and the fused kernels
that only those targets have, lowered by their own compilers.

The compilers come from requirements-compile.txt (libtpu, the CUDA plugin and cuDNN),
which CI installs. Without them the compiling tests skip, saying so; with
ODET_REQUIRE_GPU_COMPILE=1 (CI) they fail instead. The reader's and the names' tests need
neither.
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

from flax import nnx
import jax
from jax._src import config as jax_config
import jax.numpy as jnp
import pytest

from odetransformer import errors
from odetransformer.model import blocks
from odetransformer.model import config as config_lib
from odetransformer.tools import compile_targets, hlo_stats, memory

from tiny import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE = {
  "tpu": importlib.util.find_spec("libtpu") is not None,
  "cuda": importlib.util.find_spec("jax_cuda12_plugin") is not None,
}
if not all(HAVE.values()) and os.environ.get("ODET_REQUIRE_GPU_COMPILE") == "1":
  raise RuntimeError(f"ODET_REQUIRE_GPU_COMPILE=1 but a compiler is missing: {HAVE}")


def needs(platform):
  return pytest.mark.skipif(
    not HAVE[platform],
    reason=f"no {platform.upper()} compiler: pip install -r requirements-compile.txt",
  )


# --------------------------------------------------------------------------------------
# The HLO reader, on hand-written programs
# --------------------------------------------------------------------------------------
_HLO = textwrap.dedent("""\
  HloModule m

  %body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
    %p = (s32[], f32[8,128]) parameter(0)
    %ag = f32[8,128]{1,0} all-gather(f32[1,128]{1,0} %x), dimensions={0}
    %f = f32[8,128]{1,0} fusion(%ag), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"100"}}
    %cp = (f32[4,128]{1,0}, f32[4,128]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%f), source_target_pairs={{0,1}}
    %k = f32[8,128]{1,0} custom-call(%f), custom_call_target="tpu_custom_call"
    ROOT %t = (s32[], f32[8,128]) tuple(%i, %f)
  }

  %fused (a: f32[8,128]) -> f32[8,128] {
    %a = f32[8,128]{1,0} parameter(0)
    ROOT %m = f32[8,128]{1,0} multiply(%a, %a), backend_config={"estimated_cycles":"999999"}
  }

  %cond (p: (s32[], f32[8,128])) -> pred[] {
    %p = (s32[], f32[8,128]) parameter(0)
    %n = s32[]{:T(128)} constant(6)
    %i = s32[] get-tuple-element(%p), index=0
    ROOT %lt = pred[] compare(%i, %n), direction=LT
  }

  ENTRY %main (x: f32[8,128]) -> f32[8,128] {
    %x = f32[8,128]{1,0} parameter(0)
    %ar = f32[8,128]{1,0} all-reduce(%x), to_apply=%add, backend_config={"estimated_cycles":"50"}
    %w = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
    %w2 = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body
    %rs = f32[2,128]{1,0} reduce-scatter(%ar), dimensions={0}, to_apply=%add
    %c1 = f32[8,128]{1,0} all-gather(f32[1,128]{1,0} %x), frontend_attributes={chain_id="7"}
    %rss = ((f32[8,128]{1,0}, f32[16]{0}), (f32[1,128]{1,0}, f32[2]{0})) reduce-scatter-start(%x, %y)
    %ars = (f32[8,128]{1,0}, f32[16]{0}) all-reduce-start(%x, %y), to_apply=%add
    %c2 = f32[8,128]{1,0} all-gather(f32[1,128]{1,0} %x), frontend_attributes={chain_id="7"}
    ROOT %r = f32[8,128]{1,0} get-tuple-element(%w), index=1
  }
""")  # noqa: E501  (HLO lines as XLA writes them)


def test_reader_weights_collectives_and_cycles_by_trip_counts():
  """A body run 3 times (XLA's known_trip_count) and 6 times (read from its condition
  `i < 6`): its all-gather, permute, cycles and Mosaic call count 9 times; the entry's
  once. A fused computation's own cycles are its fusion op's, not added again; the two
  copies of one chained asynchronous all-gather (XLA:TPU's chain_id) count once."""
  s = hlo_stats.parse_step(_HLO)
  gather, permute, whole = 8 * 128 * 4, 4 * 128 * 4, 8 * 128 * 4
  assert s["static"]["all-gather"] == 2 * gather + gather  # the body twice, the chain
  assert s["weighted"]["all-gather"] == 9 * gather + gather
  # -start: the result half of (operand, result), without the u32[] contexts
  assert s["weighted"]["collective-permute"] == 9 * permute
  # Combined -start ops: a reduce-scatter's operands (the first half of its tuple), an
  # all-reduce's results (its whole shape).
  assert s["weighted"]["all-reduce"] == whole + (whole + 16 * 4)
  assert s["weighted"]["reduce-scatter"] == whole + (whole + 16 * 4)
  assert s["counts"] == {
    "all-gather": 10,
    "reduce-scatter": 2,
    "all-reduce": 2,
    "all-to-all": 0,
    "collective-permute": 9,
  }
  assert s["cycles"] == 50 + 9 * 100 and s["uncosted_kernels"] == 9
  assert s["unknown_trip_counts"] == 0
  no_bound = _HLO.replace("direction=LT", "direction=NE")
  assert hlo_stats.parse_step(no_bound)["unknown_trip_counts"] == 1


# --------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
  "name,platform,topology,chips,gib",
  [
    ("v5e-256", "tpu", "v5e:16x16", 256, 16),
    ("v5litepod-16", "tpu", "v5e:4x4", 16, 16),
    ("v5p-128", "tpu", "v5p:4x4x4", 64, 95),  # v5p counts TensorCores: 2 a chip
    ("h100x8", "cuda", "1x1x8", 8, 80),
    ("h100x64", "cuda", "1x8x8", 64, 80),
  ],
)
def test_target_names(name, platform, topology, chips, gib):
  t = compile_targets.parse(name)
  assert (t.platform, t.topology, t.chips, t.memory_gib) == (platform, topology, chips, gib)
  if platform == "tpu":  # the clock: bf16 peak / (2 x the MXUs' multiply-adds per cycle)
    assert 1.4e9 < t.clock_hz < 1.8e9


@pytest.mark.parametrize(
  "name,says", [("v5p-7", "v5p comes as v5p-8"), ("h100x12", "multiple of 8"), ("a100x8", "one of")]
)
def test_unknown_targets_are_one_line_errors(name, says):
  with pytest.raises(errors.UserError, match=says):
    compile_targets.parse(name)


def test_a_fused_kernel_that_fails_to_lower_names_itself_and_the_fallback():
  cfg = config_lib.ModelConfig(d_model=128, num_heads=2, dtype="bfloat16")
  tpu, gpu = compile_targets.parse("v5e-16"), compile_targets.parse("h100x8")
  line = memory.compile_failure(
    RuntimeError("INTERNAL: Mosaic failed to compile TPU kernel: bad tile\nmore"), cfg, 256, tpu
  )
  assert line == (
    "the train step does not compile for v5e-16: INTERNAL: Mosaic failed to compile TPU "
    "kernel: bad tile; it is the Pallas splash attention (Mosaic) kernel: "
    "--config.model.attention_impl=xla falls back to XLA's attention"
  )
  line = memory.compile_failure(RuntimeError("INTERNAL: no algorithm"), cfg, 256, gpu)
  assert "it may be the cuDNN flash attention kernel" in line and "\n" not in line
  xla = config_lib.ModelConfig(d_model=128, num_heads=2, attention_impl="xla")
  line = memory.compile_failure(RuntimeError("INTERNAL: no algorithm"), xla, 256, gpu)
  assert line == "the train step does not compile for h100x8: INTERNAL: no algorithm"


# --------------------------------------------------------------------------------------
# Kernels only the targets have, lowered by their compilers
# --------------------------------------------------------------------------------------
def _compiled_attention(target_name, kernel, segments, b=4, length=256, n=4, h=64):
  """HLO text of the attention's forward and backward for `target_name`'s devices,
  batch and heads split over them as the model's activation rules split them."""
  from configs import default
  from odetransformer.train import sharding

  devices = compile_targets.devices(compile_targets.parse(target_name))
  mesh = sharding.make_mesh(default.get_config().mesh, devices)
  rules = sharding.activation_rules(sharding.logical_axis_rules())
  put = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
  qkv = jax.ShapeDtypeStruct(
    (b, length, n, h),
    jnp.bfloat16,
    sharding=put(sharding.logical_to_spec(("batch", None, "heads", None), rules)),
  )
  seg = jax.ShapeDtypeStruct(  # split like the batch, as the train step's
    (b, length), jnp.int32, sharding=put(sharding.logical_to_spec(("batch", None), rules))
  )

  def forward(q, k, v, s):
    mask = blocks.attention_mask(s) if segments else None
    return blocks.dot_product_attention(q, k, v, mask, kernel)

  def step(q, k, v, s):
    loss = lambda *x: jnp.sum(forward(*x, s).astype(jnp.float32))  # noqa: E731
    return forward(q, k, v, s), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  # Never written to the tests' compilation cache: a compile-only executable cannot be
  # loaded back.
  with (
    jax.set_mesh(mesh),
    nnx.logical_axis_rules(rules),
    jax_config.persistent_cache_min_compile_time_secs(1e9),
  ):
    return jax.jit(step).lower(qkv, qkv, qkv, seg).compile().as_text()


@pytest.mark.slow
@needs("tpu")
@pytest.mark.parametrize("segments", [False, True])
def test_splash_attention_lowers_for_a_tpu_slice(segments, tmp_path):
  """Pallas's splash kernel, forward and backward, compiled by the TPU compiler (Mosaic)
  for a v5e-4 (run per shard by shard_map: Mosaic kernels are not partitioned).

  In a child process: loading libtpu registers its profiler plugin, after which a CPU
  trace in the same process misses its programs (tests/test_profile_split.py)."""
  out = tmp_path / "hlo.txt"
  script = (
    "import pathlib, test_preflight as t; "
    f"pathlib.Path({str(out)!r}).write_text(t._compiled_attention('v5e-4', 'splash', {segments}))"
  )
  env = cpu_env()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
  r = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert r.returncode == 0, r.stderr[-3000:]
  text = out.read_text()
  calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  names = " ".join(line.split("=", 1)[0] for line in calls)
  assert "splash_mha_fwd" in names and "splash_mha_dkv" in names, names
  assert "segment" in names if segments else "segment" not in names.replace("fwd_", "")


@pytest.mark.slow
@needs("cuda")
@pytest.mark.parametrize("target", ["h100x8", "h100x64"])
def test_cudnn_attention_of_packed_rows_runs_on_each_gpus_rows_forward_and_backward(target):
  """Packed rows take a lax.cond (cuDNN's packed layout, or the dense mask for a fuller
  row): every cuDNN call of both branches, forward and backward, holds one GPU's rows,
  and no array of the program holds the global batch. Under a global cond, the backward
  calls ran on the whole batch on every GPU (the cond's residuals and outputs were
  replicated); the cond now runs per GPU."""
  b, devices = 512, int(target.split("x")[1])
  text = _compiled_attention(target, "cudnn", segments=True, b=b)
  assert not re.search(rf"\b[a-z0-9]+\[{b},", text), sorted(
    set(re.findall(rf"\b[a-z0-9]+\[{b},[0-9,]*\]", text))
  )
  calls = [line for line in text.splitlines() if "__cudnn$fmha" in line]
  targets = {line.split('custom_call_target="')[1].split('"')[0] for line in calls}
  assert targets == {
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
  }, targets
  for line in calls:
    layouts = line.split("operand_layout_constraints={", 1)[1]
    assert layouts.startswith(f"bf16[{b // devices},256,4,64]"), line[:200]


@pytest.mark.slow
@needs("cuda")
def test_cudnn_causal_attention_lowers_for_h100s_without_a_mask_operand():
  """An unpacked batch (no segment ids): cuDNN's causal flash attention, forward and
  backward, on two H100s, its mask the kernel's own (no bias operand). The packed layout
  is tests/test_attention.py's."""
  text = _compiled_attention("h100x2", "cudnn", segments=False)
  calls = [line for line in text.splitlines() if "__cudnn$fmha" in line]
  targets = sorted({line.split('custom_call_target="')[1].split('"')[0] for line in calls})
  assert targets == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], targets
  for line in calls:
    config = json.loads(line.split("backend_config=", 1)[1])["cudnn_fmha_backend_config"]
    assert config["mask_type"] == "CAUSAL" and config["max_seg_per_batch"] == 1


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
def _memory(tmp_path, *args, env=None):
  out = tmp_path / "report.json"
  r = subprocess.run(
    [sys.executable, "-m", "odetransformer.memory", *args, f"--json={out}"],
    cwd=ROOT,
    env=env or cpu_env(),
    capture_output=True,
    text=True,
    timeout=900,
  )
  return r, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
@needs("tpu")
def test_preflight_for_a_tpu_slice_that_fits(tmp_path):
  """configs/default.py (a DiffEqFormer, seq 128: the splash kernel) for a v5e-16: the
  compiled peak, the planner beside it, collectives, the compiler's step time and MFU."""
  r, rep = _memory(tmp_path, "--config=configs/default.py", "--compile_for=v5e-16")
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert r.stderr.strip() == "", r.stderr  # libtpu's warnings off a TPU VM are silenced
  assert rep["target"] == "v5e-16" and rep["num_devices"] == 16 and rep["fits"]
  assert rep["device_memory_gib"] == 16 and rep["compiled"] and rep["estimate_bytes"] > 0
  h = rep["hlo"]
  assert h["counts"]["all-gather"] > 0 and h["weighted"]["all-gather"] > 0  # FSDP
  assert h["cycles"] > 0 and h["uncosted_kernels"] > 0  # splash calls: no estimate
  assert 0 < rep["step_seconds"] < 1 and 0 < rep["mfu"] < 1
  lines = r.stdout.splitlines()
  assert any(line.strip().startswith("planner's estimate") for line in lines)
  assert any(line.strip().startswith("collectives") and "all-gather" in line for line in lines)
  assert any("the TPU compiler's estimate" in line and "MFU" in line for line in lines)
  assert "per v5e-16 chip: FITS" in lines[-1]


@pytest.mark.slow
@needs("cuda")
def test_preflight_refuses_what_does_not_fit_in_one_line(tmp_path):
  """For 8 H100s with 1 MiB each: DOES NOT FIT, then the one line naming what to change,
  exit 2 (what the launch scripts refuse on)."""
  r, rep = _memory(
    tmp_path, "--config=configs/default.py", "--compile_for=h100x8", "--device_memory_gib=0.001"
  )
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
  assert not rep["fits"] and rep["target"] == "h100x8" and rep["step_seconds"] == 0
  assert "per h100x8 chip: DOES NOT FIT" in r.stdout
  (line,) = r.stderr.strip().splitlines()
  assert line.startswith("error: does not fit: ") and "per chip of h100x8" in line
  assert "--config.model.remat_policy=full" in line or "grad_accum_steps" in line


@pytest.mark.slow
@needs("tpu")
def test_a_step_the_tpu_compiler_cannot_fit_is_a_verdict_not_a_failure(tmp_path):
  """XLA:TPU refuses a program larger than the chip's HBM (RESOURCE_EXHAUSTED at compile
  time): the report is the planner's, DOES NOT FIT, and the one line quotes the compiler
  and names what to change, exit 2 (not a kernel blamed)."""
  r, rep = _memory(
    tmp_path,
    "--config=configs/default.py",
    "--compile_for=v5e-16",
    "--config.global_batch_size=65536",
    "--config.eval_batch_size=16",
  )
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
  assert not rep["fits"] and not rep["compiled"] and "RESOURCE_EXHAUSTED" in rep["compile_oom"]
  assert "the v5e-16 compiler ran out of memory" in r.stdout and "DOES NOT FIT" in r.stdout
  (line,) = r.stderr.strip().splitlines()
  assert line.startswith("error: does not fit: the v5e-16 compiler ran out of memory")
  assert "global_batch_size (now 65536)" in line and "attention" not in line


@pytest.mark.slow
def test_preflight_without_the_compiler_says_what_to_install(tmp_path):
  """libtpu hidden (a package of that name that fails to import): one line naming
  requirements-compile.txt, exit 2."""
  hide = tmp_path / "hide"
  (hide / "libtpu").mkdir(parents=True)
  (hide / "libtpu" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
  env = cpu_env(PYTHONPATH=os.pathsep.join([str(hide), str(ROOT)]))
  r, _ = _memory(tmp_path, "--config=configs/default.py", "--compile_for=v5e-16", env=env)
  assert r.returncode == 2
  (line,) = r.stderr.strip().splitlines()
  assert "needs the TPU compiler" in line and "requirements-compile.txt" in line


@pytest.mark.slow
@needs("tpu")
def test_preflight_table_benchmark_resumes_and_its_ratios_are_its_rows(tmp_path):
  """benchmarks.preflight at configs/default.py for a v5e-16: a row per model, written as
  it ends; a rerun compiles nothing (rows already there are kept); the table's ratios
  are its rows' (compiled / planner; the ODE's collective bytes over the GPT's)."""
  out = tmp_path / "table.json"
  args = [sys.executable, "-m", "benchmarks.preflight", "--configs=default"]
  args += ["--targets=v5e-16", f"--json={out}"]
  run = lambda: subprocess.run(  # noqa: E731
    args, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=900
  )
  first = run()
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [(r["kind"], r["target"]) for r in rows] == [
    ("diffeqformer", "v5e-16"),
    ("transformer", "v5e-16"),
  ]
  again = run()
  assert again.returncode == 0 and "compile" not in again.stdout.split("| config")[0]
  ode, gpt = rows
  lines = {
    line.split("|")[2].strip(): line for line in again.stdout.splitlines() if "v5e-16" in line
  }
  cells = [c.strip() for c in lines["DiffEqFormer"].split("|")]
  assert cells[6] == f"{ode['peak_gib'] / ode['estimate_gib']:.2f}"
  assert cells[8] == f"{ode['collective_gb'] / gpt['collective_gb']:.2f}"
  assert cells[11] == f"{100 * ode['mfu']:.0f}%" and ode["step_ms"] > 0
