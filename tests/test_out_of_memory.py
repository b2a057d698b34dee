"""Out of device memory is one line naming what XLA could not allocate, the planner's
estimate and what to change (odetransformer.tools.out_of_memory, main.py)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from odetransformer.tools import memory, out_of_memory

from tiny import ROOT, config_flags, cpu_env, tiny_config

GIB = 1 << 30


def _real_out_of_memory() -> jax.errors.JaxRuntimeError:
  """XLA's own error for a 4 TiB buffer on this host (no page of it is touched)."""
  try:
    jnp.zeros((1 << 40,), jnp.float32).block_until_ready()
  except jax.errors.JaxRuntimeError as e:
    return e
  pytest.skip("this host allocated 4 TiB")


def test_found_in_the_chain_and_told_in_one_line(tmp_path):
  oom = _real_out_of_memory()
  try:
    try:
      raise oom
    except jax.errors.JaxRuntimeError as e:
      raise RuntimeError("the train step failed") from e
  except RuntimeError as wrapped:
    outer = wrapped
  config = tiny_config(tmp_path)
  config.model.remat_policy = "none"
  err = out_of_memory.out_of_memory_error(outer, config)
  assert out_of_memory.find_out_of_memory(outer) is oom
  text = str(err)
  assert "\n" not in text
  assert text.startswith("out of memory on cpu: XLA could not allocate 4,096.0 GiB ")
  planned = memory.memory_report(config, compile_step=False).total_bytes
  assert f"the planner estimates {planned / GIB:,.1f} GiB per device" in text
  assert "--config.model.remat_policy=full (now 'none')" in text
  assert "--config.optim.grad_accum_steps=2 " in text
  assert "--config.global_batch_size (now 4)" in text


def test_other_errors_are_not_out_of_memory(tmp_path):
  try:
    jnp.ones((2, 3)) @ jnp.ones((2, 3))
  except TypeError as e:
    assert out_of_memory.out_of_memory_error(e, tiny_config(tmp_path)) is None
  assert out_of_memory.find_out_of_memory(ValueError("RESOURCE_EXHAUSTED")) is None
  assert out_of_memory.requested_bytes("Out of memory allocating 4096 bytes.") == 4096
  assert (
    out_of_memory.requested_bytes(
      "Failed to allocate request for 24.00GiB (25769803776B) on device ordinal 0"
    )
    == 25769803776
  )


@pytest.mark.slow
def test_main_reports_a_model_too_big_in_one_line(tmp_path, shared_data_cache):
  """A model whose MLP weights are 256 GiB: main.py ends with the one line, exit 2, and
  no checkpoint is written."""
  c = tiny_config(shared_data_cache, num_train_steps=2)
  c.model.kind = "transformer"
  c.model.mlp_dim = 1 << 30
  workdir = tmp_path / "run"
  proc = subprocess.run(
    [
      sys.executable,
      "main.py",
      "--config=configs/default.py",
      f"--workdir={workdir}",
      *config_flags(c),
    ],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and proc.stderr.rstrip().endswith(lines[0])
  assert lines[0].startswith("error: out of memory on cpu: XLA could not allocate ")
  assert "the planner estimates " in lines[0] and "--config.mesh.shape" in lines[0]
  assert not list((workdir / "checkpoints").glob("*"))
