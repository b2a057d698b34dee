"""The tiny training config shared by tests that need a real (seconds-sized) run, the
environment of the tests' child processes, and the runner of scripts that need 8 host
CPU devices."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Compilation is most of the suite's time, and these programs are seconds-sized: XLA:CPU's
# LLVM backend at -O0, with its loop emitters instead of the MLIR fusion emitters
# (xla_cpu_use_fusion_emitters=false), compiles them several times faster (measured side
# by side: the commit that added the second flag). What the tests check (the HLO
# programs, their shardings and memory plans, numerics to float tolerance) does not
# depend on how the machine code is emitted; the benchmarks, run for their figures
# outside the tests, keep XLA's default.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
                  "--xla_cpu_use_fusion_emitters=false")


def cpu_env(devices: int = 0, **extra) -> dict:
  """os.environ for a child process on host CPU devices (`devices` > 0: that many)
  with the tests' XLA flags, plus `extra`."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
  flags = TEST_XLA_FLAGS
  if devices:
    flags += f" --xla_force_host_platform_device_count={devices}"
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **{k: str(v) for k, v in extra.items()})
  return env


def tiny_config(cache_dir, num_train_steps=4):
  """A seconds-sized run on the embedded corpus (callers override what they test)."""
  from configs import default  # pylint: disable=g-import-not-at-top  (conftest imports this module before jax)
  c = default.get_config()
  c.num_train_steps = num_train_steps
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  c.seq_len = 32
  c.global_batch_size = 4
  c.eval_batch_size = 4
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.mlp_dim = 64
  c.model.solver_steps = c.model.num_layers = 2
  c.model.max_len = 32
  c.model.time_embed_dim = 8
  c.model.time_sinusoids = 8
  c.data.vocab_size = 512
  c.data.tokenizer_sample_bytes = 300_000
  c.data.eval_max_batches = 2
  if cache_dir is not None:                  # None: the default cache
    c.data.cache_dir = str(cache_dir)
  return c


def tiny_run_config(cache_dir):
  """tiny_config as a 2-step, K=3 run with batches of 2 (the inference tools' fixture)."""
  c = tiny_config(cache_dir, num_train_steps=2)
  c.global_batch_size = c.eval_batch_size = 2
  c.model.solver_steps = c.model.num_layers = 3
  c.data.eval_max_batches = 1
  return c


def config_flags(config, base=None) -> list:
  """`config` as main.py flags: --config.<key>=<value> for each leaf that differs from
  `base` (default: configs/default.py's; the config file main.py is given), so subprocess
  tests run exactly the config the in-process ones do."""
  def leaves(node, prefix=""):
    for key, value in node.items():
      if hasattr(value, "items"):
        yield from leaves(value, f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}", value
  if base is None:
    from configs import default  # pylint: disable=g-import-not-at-top
    base = default.get_config()
  base = dict(leaves(base))
  return [f"--config.{key}={value}" for key, value in leaves(config)
          if key not in base or base[key] != value]


def run_on_8_cpu_devices(script_text: str, tmp_path, timeout: int):
  """Runs `script_text` in its own process on 8 host CPU devices (its argv[1] is the
  repository root) and returns (the JSON of its last stdout line, its stderr)."""
  env = cpu_env(8)
  script = pathlib.Path(tmp_path) / "on_8_devices.py"
  script.write_text(script_text)
  proc = subprocess.run([sys.executable, str(script), str(ROOT)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
