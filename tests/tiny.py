"""The tiny training config shared by tests that need a real (seconds-sized) run, the
environment of the tests' child processes, and the runner of scripts that need 8 host
CPU devices."""

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Compilation is most of the suite's time, and these programs are seconds-sized: XLA:CPU's
# LLVM backend at -O0, with its loop emitters instead of the MLIR fusion emitters
# (xla_cpu_use_fusion_emitters=false), compiles them several times faster (measured side
# by side: the commit that added the second flag). What the tests check (the HLO
# programs, their shardings and memory plans, numerics to float tolerance) does not
# depend on how the machine code is emitted; the benchmarks, run for their figures
# outside the tests, keep XLA's default. On a GPU, XLA's own ops are made deterministic
# (scatter-adds without atomics, no nondeterministic algorithms), which the tests of exact
# resumes and of runs that must agree bit for bit ask for; XLA:CPU's already are.
WANTED_TEST_XLA_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_gpu_deterministic_ops=true",
)
# Where the flags this jax's XLA accepts are handed on: pytest's workers and every process
# the tests start inherit it, so XLA is asked once per session.
KNOWN_FLAGS_ENV = "ODET_TEST_XLA_FLAGS"
_PROBE = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"


def xla_accepts(flags) -> bool:
  """Whether a process with `flags` as its XLA_FLAGS (and the caller's JAX_PLATFORMS)
  compiles a program. XLA aborts the whole process on a flag it does not know (another
  version of XLA may not know a test's flag), so it is asked in a child process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
  env.update(XLA_FLAGS=" ".join(flags), XLA_PYTHON_CLIENT_PREALLOCATE="false")
  proc = subprocess.run(
    [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
  )
  if proc.returncode == 0:
    return True
  if "Unknown flag" in proc.stderr and any(f.split("=")[0] in proc.stderr for f in flags):
    return False
  raise RuntimeError(
    f"probing XLA_FLAGS={' '.join(flags)!r} failed for another reason "
    f"than an unknown flag:\n{proc.stderr[-3000:]}"
  )


def known_xla_flags(flags) -> list:
  """The flags of `flags` that XLA accepts (all of them in one child when it knows
  them all, the usual case; else one child each)."""
  if xla_accepts(flags):
    return list(flags)
  return [f for f in flags if xla_accepts([f])]


def session_xla_flags() -> str:
  """WANTED_TEST_XLA_FLAGS less those this XLA does not know, as XLA_FLAGS text: from
  KNOWN_FLAGS_ENV when a parent process has asked already, else asked now and put there."""
  if KNOWN_FLAGS_ENV not in os.environ:
    os.environ[KNOWN_FLAGS_ENV] = " ".join(known_xla_flags(WANTED_TEST_XLA_FLAGS))
  return os.environ[KNOWN_FLAGS_ENV]


TEST_XLA_FLAGS = session_xla_flags()


# The tests' compiled programs are kept between sessions, as pip keeps its downloads: a
# second run of the suite (an edit, a fresh clone on the same machine) loads most of them
# instead of compiling them again (how many each module compiles and loads: pytest's
# `-p tests.suite_timeline`, tests/suite_timeline.py).
COMPILE_CACHE_ENV = "ODET_TEST_COMPILE_CACHE"  # a directory, or "off": the session's own
COMPILE_CACHE_LIMIT_BYTES = 1 << 30  # past this, the oldest entries go at a session's start


def _host_id() -> str:
  """This machine's processor (XLA:CPU compiles for the features it has)."""
  text = platform.machine() + platform.processor()
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
    text += "".join(l for l in info.splitlines() if l.startswith(("model name", "flags")))
  except OSError:
    pass
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def kept_compile_cache() -> pathlib.Path | None:
  """The directory of compiled programs kept between test sessions (None: the session
  keeps its own): $ODET_TEST_COMPILE_CACHE, by default ~/.cache/odetransformer/
  test-compile-cache, in a subdirectory per jaxlib and processor. jax keys each program by
  its HLO, compile options, XLA flags and devices; entries beyond the size limit are
  removed oldest first."""
  setting = os.environ.get(COMPILE_CACHE_ENV, "")
  if setting == "off":
    return None
  root = pathlib.Path(setting) if setting else _default_cache_root()
  path = root / f"jaxlib-{importlib.metadata.version('jaxlib')}-{_host_id()}"
  path.mkdir(parents=True, exist_ok=True)
  _prune(path, COMPILE_CACHE_LIMIT_BYTES)
  return path


def _default_cache_root() -> pathlib.Path:
  home = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(home) / "odetransformer" / "test-compile-cache"


def _prune(path: pathlib.Path, limit: int):
  """Removes the oldest files of `path` until it holds at most half of `limit`, once it
  holds more than `limit`."""
  with os.scandir(path) as entries:  # one stat per file (a DirEntry keeps its own)
    files = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in entries if e.is_file())
  total = sum(size for _, size, _ in files)
  if total <= limit:
    return
  for _, size, file in files:
    if total <= limit // 2:
      break
    pathlib.Path(file).unlink(missing_ok=True)
    total -= size


def cpu_env(devices: int = 0, **extra) -> dict:
  """os.environ for a child process on host CPU devices (`devices` > 0: that many)
  with the tests' XLA flags, plus `extra`."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}
  flags = TEST_XLA_FLAGS
  if devices:
    flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **{k: str(v) for k, v in extra.items()})
  return env


def tiny_config(cache_dir, num_train_steps=4):
  """A seconds-sized run on the embedded corpus (callers override what they test)."""
  from configs import default  # lazy: imports jax; conftest imports this module before jax

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
  if cache_dir is not None:  # None: the default cache
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
    from configs import default  # lazy: as in tiny_config

    base = default.get_config()
  base = dict(leaves(base))
  return [
    f"--config.{key}={value}"
    for key, value in leaves(config)
    if key not in base or base[key] != value
  ]


def every_process_writes_the_compile_cache():
  """In a process of a multi-process group (jax.distributed), writes this process's
  compiled programs to the persistent compilation cache, as process 0's are.

  jax writes from process 0 alone (against contention on shared filesystems), but on
  host CPU devices a program's cache key holds its process's own topology fingerprint:
  the other processes' keys are never written, and each group's process 1 compiled every
  program afresh, the kept cache or not. Their keys differ, so no two processes write
  one entry. A jax whose private writer has another signature is left as it is (the
  tests then compile more, and still pass)."""
  import inspect
  import warnings

  from jax._src import compilation_cache, compiler, config

  expected = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]
  if list(inspect.signature(compiler._cache_write).parameters)[:5] != expected:
    return

  def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
      return  # as jax: programs with host callbacks are not cached, nor quick ones
    try:
      compilation_cache.put_executable_and_time(
        cache_key, module_name, executable, backend, int(compile_time_secs)
      )
    except Exception as e:  # as jax: a failed write only warns
      warnings.warn(f"not written to the compilation cache: {module_name}: {e!r}", stacklevel=2)

  compiler._cache_write = write


def run_script(script_text: str, tmp_path, *args, timeout: int, devices: int = 0):
  """Runs `script_text` (written into `tmp_path`) in its own process on host CPU devices
  (`devices` > 0: that many), from the repository root, with `args` as its argv[1:];
  returns (the JSON of its last stdout line, its stderr)."""
  script = pathlib.Path(tmp_path) / "script.py"
  script.write_text(script_text)
  proc = subprocess.run(
    [sys.executable, str(script), *map(str, args)],
    env=cpu_env(devices),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def run_on_8_cpu_devices(script_text: str, tmp_path, timeout: int):
  """run_script on 8 host CPU devices, its argv[1] the repository root."""
  return run_script(script_text, tmp_path, ROOT, timeout=timeout, devices=8)


@contextlib.contextmanager
def reused_compiled_steps():
  """Within the block, runs in this process whose config is the same share one state
  layout and jitted init, train step, eval step and parameter norm, as one run's steps
  serve all its calls (each init call still creates a fresh state).

  Each `loop.train_and_evaluate` builds its steps anew, so a second run of the same
  config traces and lowers them again and loads them from the persistent compilation
  cache: much of a tiny run's time (the figure: the commit that added this). Here
  the optimizer and schedule of an optim config and step count are made once, and each
  step builder returns the function it built for the same layout (its structure, shapes
  and shardings: a model config, optimizer or mesh of its own is another program),
  schedule, rules and options. jax retraces such a function when its arguments' pytree
  or shapes differ, as within one run. Every key also holds the logical-axis rules in
  force, the PRNG and the identities of the model package's functions: a test that
  patches one of them gets a layout, init and steps of its own."""
  from flax.core import spmd  # lazy, as jax below
  import jax  # lazy: conftest imports this module before jax

  from odetransformer.train import optimizer, steps

  memo = {}

  def layout_key(layout):
    leaves, treedef = jax.tree.flatten(layout.abstract)
    return (
      repr(layout.graphdef),  # the model config, optimizer (by identity), static fields
      treedef,
      tuple((x.shape, x.dtype, x.sharding) for x in leaves),
    )

  def optim_key(optim, num_train_steps, **kw):
    # An OptimConfig (frozen: its repr is every field), or a test's optim ConfigDict.
    text = repr(optim) if dataclasses.is_dataclass(optim) else optim.to_json(sort_keys=True)
    return (text, num_train_steps, tuple(sorted(kw.items())))

  def model_code():
    """The identities of the model package's functions and methods: a test that patches
    one (test_reliability's other array layout) builds other programs."""
    return hash(
      tuple(
        id(member)
        for name, module in sorted(sys.modules.items())
        if name.startswith("odetransformer.model.")
        for value in vars(module).values()
        for member in ([value, *vars(value).values()] if isinstance(value, type) else [value])
        if callable(member)
      )
    )

  def context():  # what tracing reads besides the arguments
    return repr(spmd.get_logical_axis_rules()), jax.config.jax_default_prng_impl, model_code()

  # name -> (its module, the key of its arguments; `context()` is added to every key). The
  # optimizer `tx` is keyed by identity (the memoised create_optimizer's), as the schedule is.
  builders = {
    "create_optimizer": (optimizer, optim_key),
    "learning_rate_schedule": (optimizer, optim_key),
    "state_layout": (steps, lambda cfg, tx, seed, mesh: (repr(cfg), tx, seed, mesh)),
    "make_init": (steps, lambda layout, cfg, tx, seed: (layout_key(layout), repr(cfg), tx, seed)),
    "make_train_step": (
      steps,
      lambda layout, schedule, rules, **kw: (
        layout_key(layout),
        schedule,  # by identity: the schedule above, or a test's own function
        repr(rules),
        tuple(sorted(kw.items())),
      ),
    ),
    "make_eval_step": (steps, lambda layout, rules: (layout_key(layout), repr(rules))),
    "make_param_norm": (steps, lambda layout: (layout_key(layout),)),
  }

  def reused(name, build, key_of):
    def build_once(*args, **kwargs):
      key = (name, key_of(*args, **kwargs), context())
      if key not in memo:
        memo[key] = build(*args, **kwargs)
      return memo[key]

    return build_once

  originals = {name: getattr(module, name) for name, (module, _) in builders.items()}
  for name, (module, key_of) in builders.items():
    setattr(module, name, reused(name, originals[name], key_of))
  try:
    yield
  finally:
    for name, (module, _) in builders.items():
      setattr(module, name, originals[name])
