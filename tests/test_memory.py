"""odetransformer.tools.memory: per-device memory report (analytic and compiled paths)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from configs import default
from odetransformer.model import blocks
from odetransformer.model import config as config_lib
from odetransformer.model.param_count import count_params
from odetransformer.tools import memory

from tiny import config_flags, cpu_env, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tiny_flags():
  """tests/tiny.py's config (batch 8: 4 batch shards in the mesh test) as CLI flags."""
  c = tiny_config(None)
  c.global_batch_size = 8
  return config_flags(c)


TINY = _tiny_flags()


def small_config():
  c = default.get_config()
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.mlp_dim = 128
  c.model.solver_steps = c.model.num_layers = 3
  c.model.time_embed_dim = 8
  c.model.time_sinusoids = 8
  c.data.vocab_size = 512
  return c


def _cli(tmp_path, *args, timeout=150, returncode=0):
  out = tmp_path / "report.json"
  env = cpu_env()
  r = subprocess.run(
    [sys.executable, "-m", "odetransformer.tools.memory", *args, f"--json={out}"],
    cwd=str(ROOT),
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert r.returncode == returncode, r.stderr[-3000:]
  if returncode:
    return r.stdout, r.stderr, json.loads(out.read_text())
  return r.stdout, json.loads(out.read_text())


def test_param_bytes_equal_eval_shape_count():
  config = small_config()
  cfg = config_lib.model_config(config, config.data.vocab_size)
  r = memory.memory_report(config, compile_step=False, devices=jax.devices()[:1])
  n = count_params(cfg)
  assert r.num_params == n
  assert r.param_bytes == n * 4  # float32 params, one device holds all
  assert r.opt_state_bytes >= 2 * n * 4  # Adam mu and nu (+ step counters)
  assert r.grad_bytes == n * 4
  assert not r.compiled and r.total_bytes > r.state_bytes


@pytest.mark.slow
def test_analytic_cli_shards_params_over_fake_devices(tmp_path):
  config = small_config()
  n = count_params(config_lib.model_config(config, config.data.vocab_size))
  args = [
    "--config=configs/default.py",
    "--num_devices=4",
    "--nocompile",
    "--config.model.d_model=64",
    "--config.model.num_heads=4",
    "--config.model.mlp_dim=128",
    "--config.model.solver_steps=3",
    "--config.model.time_embed_dim=8",
    "--config.model.time_sinusoids=8",
    "--config.data.vocab_size=512",
  ]
  stdout, rep = _cli(tmp_path, *args)
  assert rep["num_devices"] == 4 and rep["mesh_shape"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert rep["num_params"] == n and not rep["compiled"]
  # FSDP: about a quarter of the parameters per device (small unsharded leaves aside).
  assert n * 4 / 4 <= rep["param_bytes"] < n * 4 / 2
  assert "analytic" in stdout and "FITS" in stdout


def _weight_heavy_flags():
  """A DiffEqFormer whose generated weights W(t) outweigh its activations: K = 8 steps
  of a 128-wide layer on 8-token rows, one row per device."""
  c = tiny_config(None)
  c.model.d_model, c.model.num_heads, c.model.mlp_dim, c.model.solver_steps = 128, 4, 512, 8
  c.seq_len, c.global_batch_size, c.eval_batch_size = 8, 4, 4
  return config_flags(c)


@pytest.mark.slow
def test_compiled_cli_on_four_fake_devices(tmp_path):
  """Train and eval steps compiled on 4 devices (fsdp 4); the eval step's generated
  weights are sharded as the train step's: its temporaries hold a quarter of the K
  weights W(t_k), not all of them whole (over twice the bound below when they were)."""
  stdout, rep = _cli(
    tmp_path,
    "--config=configs/default.py",
    "--num_devices=4",
    "--config.mesh.shape=1,-1,1",
    *_weight_heavy_flags(),
  )
  assert rep["compiled"] and rep["mesh_shape"] == {"data": 1, "fsdp": 4, "tensor": 1}
  x = rep["xla"]
  assert x["temp_size_in_bytes"] > 0 and x["argument_size_in_bytes"] > 0
  # The donated state (params + Adam) is among the step's arguments.
  assert x["argument_size_in_bytes"] >= rep["state_bytes"]
  assert "compiled train step" in stdout and "XLA temporaries" in stdout
  # The eval step: the model is its argument (the optimizer state, unused, is pruned),
  # not donated; no gradients, no Adam update.
  e = rep["eval_xla"]
  model_bytes = rep["param_bytes"] + rep["other_model_bytes"]
  assert model_bytes <= e["argument_size_in_bytes"] < rep["state_bytes"]
  assert e["alias_size_in_bytes"] == 0 and rep["eval_bytes"] < rep["total_bytes"]
  cfg = config_lib.ModelConfig(d_model=128, num_heads=4, mlp_dim=512, solver_steps=8, num_layers=8)
  generated = 8 * sum(math.prod(s.shape) for s in blocks.layer_param_specs(cfg).values()) * 4
  assert e["temp_size_in_bytes"] < 0.75 * generated, (e, generated)
  assert "eval step peak" in stdout


@pytest.mark.slow
def test_large_config_uses_the_analytic_path_and_a_verdict(tmp_path):
  """...and a config that does not fit ends with the one line naming what to change,
  exit 2 (the report is written first)."""
  stdout, stderr, rep = _cli(
    tmp_path,
    "--config=configs/owt_large.py",
    "--num_devices=8",
    "--device_memory_gib=1",
    timeout=60,
    returncode=2,
  )
  assert not rep["compiled"] and rep["num_params"] > 1_000_000_000
  assert rep["mesh_shape"]["fsdp"] == 8
  assert "DOES NOT FIT" in stdout and not rep["fits"]
  (line,) = stderr.strip().splitlines()
  assert line.startswith("error: does not fit: ") and "per device, 1 GiB there" in line


@pytest.mark.slow
def test_bad_mesh_is_a_one_line_error(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "odetransformer.tools.memory",
      "--config=configs/default.py",
      "--num_devices=4",
      "--config.mesh.shape=3,-1,1",
    ],
    cwd=str(ROOT),
    capture_output=True,
    text=True,
    timeout=60,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 2
  assert "mesh.shape" in r.stderr and "Traceback" not in r.stderr
