"""The project as a package (pyproject.toml) and the test set-up around it: what the wheel
holds and that it imports without the checkout, its dependencies against the pinned
requirements, the test tiers (a test that starts processes is marked slow), the XLA-flag
probe, the matmul-precision marker and the TF32 emulation used to find where it is needed.
"""

import importlib.metadata
import importlib.util
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
  return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement)[0]).lower()


def _pins(*files) -> dict:
  """{normalised name: version} of the `name==v` / `name~=v` lines of requirements files."""
  pins = {}
  for f in files:
    for line in (ROOT / f).read_text(encoding="utf-8").splitlines():
      m = re.match(r"([A-Za-z0-9_.\-]+)\s*(==|~=)\s*([0-9][^\s#;]*)", line)
      if m:
        pins[_name(m[1])] = m[3]
  return pins


def test_dependencies_are_lower_bounds_at_the_requirements_pins():
  """pyproject declares what the library needs as `>=` the version requirements*.txt pin
  (the set the tests run with), so the two lists cannot drift apart."""
  tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  groups = {
    "requirements.txt": project["dependencies"] + project["optional-dependencies"]["test"],
    "requirements-eval.txt": project["optional-dependencies"]["eval"],
    "requirements-export.txt": project["optional-dependencies"]["export"],
    "requirements-import.txt": project["optional-dependencies"]["import"],
  }
  for requirements, declared in groups.items():
    pins = _pins(requirements)
    for dep in declared:
      name, bound = _name(dep), dep.split(">=")[1]
      assert name in pins, f"{dep} is not pinned in {requirements}"
      assert pins[name] == bound, (dep, requirements, pins[name])


def test_no_test_edits_sys_path():
  """The packages come installed and the repository root from pytest's `pythonpath`
  (child processes: PYTHONPATH from conftest); no test or script a test runs patches it."""
  edit = re.compile(r"sys\.path\s*(\.insert|\.append|\.extend|\[[^\]]*\]\s*=|\+?=)")
  offenders = [
    f"{p.name}:{i}"
    for p in sorted((ROOT / "tests").glob("*.py"))
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
    if edit.search(line)
  ]
  assert not offenders, offenders


def _declared_scripts() -> dict:
  """pyproject.toml's [project.scripts]: {script: "module:function"}."""
  tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
  return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


def test_every_console_script_runs_its_command_module_as_python_m_does(monkeypatch):
  """Each script pyproject declares resolves to a function that takes no argument and
  runs, as `__main__`, the module `odetransformer.scripts.SCRIPTS` names for it (an
  existing module); the two lists hold the same scripts."""
  from odetransformer import scripts

  declared = _declared_scripts()
  assert set(declared) == set(scripts.SCRIPTS)
  ran = []
  monkeypatch.setattr(scripts.runpy, "run_module", lambda name, **kw: ran.append((name, kw)))
  for script, target in declared.items():
    module_name, _, attr = target.partition(":")
    function = getattr(importlib.import_module(module_name), attr)
    assert callable(function), target
    assert not [
      p for p in inspect.signature(function).parameters.values() if p.default is p.empty
    ], f"{target} needs arguments"
    ran.clear()
    function()
    assert ran == [(scripts.SCRIPTS[script], {"run_name": "__main__", "alter_sys": True})]
    assert importlib.util.find_spec(scripts.SCRIPTS[script]) is not None, script


def test_every_command_the_readme_gives_has_a_console_script():
  """Each `python -m <module>` of the installed packages that README.md and
  launch/README.md give (and the trainer, `python main.py`, which runs
  odetransformer.tools.train) is what a console script runs; benchmarks are not
  installed."""
  from odetransformer import scripts

  text = "".join((ROOT / f).read_text(encoding="utf-8") for f in ("README.md", "launch/README.md"))
  commands = set(
    re.findall(r"python3? -m ((?:odetransformer|input_pipeline)(?:\.[a-z_][a-z0-9_]*)+)\b", text)
  )
  assert "odetransformer.evaluate" in commands and "odetransformer.analysis.spectra" in commands
  assert "python main.py" in text and "main.py" in scripts.__doc__
  commands.add("odetransformer.tools.train")
  assert commands <= set(scripts.SCRIPTS.values()), sorted(commands - set(scripts.SCRIPTS.values()))
  main_py = (ROOT / "main.py").read_text(encoding="utf-8")
  assert 'run_module("odetransformer.tools.train", run_name="__main__"' in main_py


@pytest.mark.slow
def test_the_wheel_holds_the_two_packages_and_imports_without_the_checkout(tmp_path):
  """`pip install .` installs odetransformer and input_pipeline, every module of both and
  nothing else; installed into a fresh directory, they import from there in a process
  whose path has no checkout (the tools' `python -m odetransformer.<tool>` included)."""
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "-q",
      "--no-deps",
      "--no-build-isolation",
      "-w",
      str(tmp_path / "dist"),
      str(ROOT),
    ],
    check=True,
    capture_output=True,
    timeout=300,
  )
  (wheel,) = (tmp_path / "dist").glob("odetransformer-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {
    "odetransformer",
    "input_pipeline",
  }
  modules = {
    p.relative_to(ROOT).as_posix()
    for package in ("odetransformer", "input_pipeline")
    for p in (ROOT / package).rglob("*.py")
  }
  assert modules <= names, sorted(modules - names)
  data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "odetransformer").rglob("*.txtpb")}
  assert data and data <= names, sorted(data - names)  # the H100's compile target

  site = tmp_path / "site"
  subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "-q",
      "--no-deps",
      "--no-compile",
      "--target",
      str(site),
      str(wheel),
    ],
    check=True,
    capture_output=True,
    timeout=300,
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  script = textwrap.dedent("""
      import odetransformer, input_pipeline
      from odetransformer.model import config
      from input_pipeline import tokenizer
      print(odetransformer.__file__, input_pipeline.__file__)
      """)
  out = subprocess.run(
    [sys.executable, "-c", script],
    cwd=tmp_path,
    env=env,
    check=True,
    capture_output=True,
    text=True,
    timeout=300,
  ).stdout.split()
  assert all(path.startswith(str(site)) for path in out), out
  r = subprocess.run(
    [sys.executable, "-m", "odetransformer.generate", "--help"],
    cwd=tmp_path,
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  # absl prints a tool's usage (its module docstring and flags) for --help, and exits 1.
  assert "--workdir" in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]
  # The console scripts are installed, and run their command as `python -m` does: its
  # docstring and its own flags for --helpshort.
  installed = {p.name for p in (site / "bin").iterdir()}
  assert set(_declared_scripts()) <= installed, installed
  for script, first_line in [
    ("odet-evaluate", "Perplexity of a trained model"),
    ("odet-train", "Trains (or resumes) a model from a config file."),
  ]:
    r = subprocess.run(
      [sys.executable, str(site / "bin" / script), "--helpshort"],
      cwd=tmp_path,
      env=dict(env, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert r.stdout.startswith(first_line), (script, r.stdout[:500], r.stderr[-2000:])
    assert "--workdir" in r.stdout and "Traceback" not in r.stderr, r.stderr[-2000:]


# --------------------------------------------------------------------------------------
# The XLA flags of the tests
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_probe_keeps_known_flags_and_drops_an_unknown_one():
  """XLA aborts a process whose XLA_FLAGS holds a flag it does not know (another XLA
  version, e.g. the GPU image's); the probe leaves such a flag out and keeps the rest."""
  known = "--xla_backend_optimization_level=0"
  unknown = "--xla_no_such_flag_for_the_tests_probe=true"
  assert tiny.xla_accepts([known])
  assert not tiny.xla_accepts([unknown])
  assert tiny.known_xla_flags([known, unknown]) == [known]


@pytest.mark.slow
def test_a_probe_that_fails_for_another_reason_is_an_error(monkeypatch):
  """Not every failure is an unknown flag: one that is not is raised, not read as 'drop
  all flags'."""
  monkeypatch.setenv("JAX_PLATFORMS", "no_such_platform")
  with pytest.raises(RuntimeError, match="another reason"):
    tiny.xla_accepts(["--xla_backend_optimization_level=0"])


def test_the_session_flags_reach_workers_and_children_once_probed():
  """The probe ran once (in the process that started the session) and its result is in
  the environment every worker and child inherits; the children's XLA_FLAGS hold it."""
  assert os.environ[tiny.KNOWN_FLAGS_ENV] == tiny.TEST_XLA_FLAGS
  assert set(tiny.TEST_XLA_FLAGS.split()) <= set(tiny.WANTED_TEST_XLA_FLAGS)
  assert tiny.TEST_XLA_FLAGS in os.environ["XLA_FLAGS"]
  flags = tiny.cpu_env(8)["XLA_FLAGS"].split()
  assert flags == tiny.TEST_XLA_FLAGS.split() + ["--xla_force_host_platform_device_count=8"]


def test_the_kept_compile_cache_is_per_jaxlib_and_processor_and_bounded(tmp_path, monkeypatch):
  """The programs kept between sessions sit under $ODET_TEST_COMPILE_CACHE, one directory
  per jaxlib and processor; past the limit the oldest files go, down to half of it; "off"
  keeps none."""
  monkeypatch.setenv(tiny.COMPILE_CACHE_ENV, "off")
  assert tiny.kept_compile_cache() is None
  monkeypatch.setenv(tiny.COMPILE_CACHE_ENV, str(tmp_path))
  path = tiny.kept_compile_cache()
  assert path.parent == tmp_path and path.is_dir()
  assert path.name.startswith(f"jaxlib-{importlib.metadata.version('jaxlib')}-")
  monkeypatch.setattr(tiny, "COMPILE_CACHE_LIMIT_BYTES", 10)
  for age, name in enumerate(["newest", "newer", "older", "oldest"]):
    (path / name).write_bytes(b"1234")
    os.utime(path / name, (1e9 - age, 1e9 - age))
  assert tiny.kept_compile_cache() == path  # 16 bytes > 10: down to <= 5
  assert sorted(p.name for p in path.iterdir()) == ["newest"]
  assert tiny.kept_compile_cache() == path  # 4 bytes <= 10: kept
  assert [p.name for p in path.iterdir()] == ["newest"]


# --------------------------------------------------------------------------------------
# Matmul precision
# --------------------------------------------------------------------------------------
@pytest.mark.matmul_precision("highest")
def test_a_test_marked_with_a_matmul_precision_runs_under_it():
  assert jax.config.jax_default_matmul_precision == "highest"


def test_an_unmarked_test_runs_at_the_default_precision():
  assert jax.config.jax_default_matmul_precision is None


_TF32_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import tf32
    tf32.emulate_tf32_on_cpu()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 256)), rng.standard_normal((256, 32))
    want = a @ b                                           # float64
    def err(precision=None):
      got = jax.jit(lambda x, y: jnp.einsum("ik,kj->ij", x, y, precision=precision))(
          a.astype(np.float32), b.astype(np.float32))
      return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
    with jax.default_matmul_precision("highest"):
      under_context = err()
    bf16 = float(jax.jit(lambda x: x @ x.T)(jnp.ones((4, 4), jnp.bfloat16))[0, 0])
    print(json.dumps({"default": err(), "highest": err("highest"), "context": under_context,
                      "bf16": bf16}))
    """)


@pytest.mark.slow
def test_the_tf32_emulation_rounds_only_default_precision_float32_dots(tmp_path):
  """On the CPU with ODET_TEST_EMULATE_TF32, a default-precision float32 dot is off by
  TF32's ~1e-3 (what a GPU gives), one at 'highest' (asked for, or from the marker's
  context) by float32's ~1e-7; other dtypes compile and run as before."""
  out = subprocess.run(
    [sys.executable, "-c", _TF32_SCRIPT],
    env=tiny.cpu_env(),
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  ).stdout
  errors = json.loads(out.strip().splitlines()[-1])
  assert 1e-4 < errors["default"] < 1e-2, errors
  assert errors["highest"] < 1e-5 and errors["context"] < 1e-5, errors
  assert errors["bf16"] == 4.0


def test_float32_matmuls_in_this_process_are_exact_to_float32_on_the_cpu():
  """Without the emulation the CPU computes float32 dots in float32 at any precision:
  why float32 tests pass here either way, and need the marker only on a GPU or TPU."""
  if os.environ.get("ODET_TEST_EMULATE_TF32") == "1" or jax.default_backend() != "cpu":
    pytest.skip("float32 dots at the default precision are TF32 here")
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((64, 256)), rng.standard_normal((256, 32))
  got = jnp.asarray(a, jnp.float32) @ jnp.asarray(b, jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float64), a @ b, rtol=0, atol=1e-4)
