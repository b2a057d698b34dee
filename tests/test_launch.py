"""launch/ scripts: valid bash, shellcheck-clean, `--help` works offline, dry runs."""

import os
import pathlib
import re
import shutil
import subprocess
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ["launch/tpu_pod.sh", "launch/gpu_slurm.sbatch", "launch/gpu_multinode.sh"]


def _offline_env(tmp_path):
  """PATH with only basic tools: no gcloud, srun, sbatch, ssh or scontrol."""
  bindir = tmp_path / "bin"
  bindir.mkdir(exist_ok=True)
  for tool in (
    "cat",
    "dirname",
    "sed",
    "seq",
    "hostname",
    "printf",
    "env",
    "head",
    "wc",
    "mktemp",
    "tar",
    "rm",
  ):
    path = shutil.which(tool)
    if path and not (bindir / tool).exists():
      (bindir / tool).symlink_to(path)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_"))}
  env["PATH"] = str(bindir)
  return env


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
  subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_strict_mode(script):
  assert "set -euo pipefail" in (ROOT / script).read_text()


@pytest.mark.parametrize("script", SCRIPTS + ["launch/common.sh"])
def test_shellcheck(script):
  if shutil.which("shellcheck") is None:
    if os.environ.get("ODET_REQUIRE_SHELLCHECK"):
      pytest.fail(
        "shellcheck is not installed but ODET_REQUIRE_SHELLCHECK is set "
        "(apt-get install -y shellcheck)"
      )
    pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
  # -x: follow the scripts' `source launch/common.sh` (paths relative to the root).
  r = subprocess.run(
    ["shellcheck", "-x", "-s", "bash", script], cwd=str(ROOT), capture_output=True, text=True
  )
  assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_offline(script, flag, tmp_path):
  for tool in ("gcloud", "srun", "sbatch", "ssh", "scontrol"):
    assert shutil.which(tool, path=_offline_env(tmp_path)["PATH"]) is None
  r = subprocess.run(
    ["/bin/bash", str(ROOT / script), flag],
    env=_offline_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=20,
  )
  assert r.returncode == 0, r.stderr
  assert "usage" in r.stdout.lower()
  assert "--config" in r.stdout and "--workdir" in r.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_workdir_is_a_one_line_error(script, tmp_path):
  args = ["--name", "x", "--zone", "z"] if script.endswith("tpu_pod.sh") else []
  r = subprocess.run(
    ["/bin/bash", str(ROOT / script), *args],
    env=_offline_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=20,
  )
  assert r.returncode == 2
  assert "workdir" in r.stderr


def _dry_run(script, args, tmp_path, root=ROOT, **env):
  e = _offline_env(tmp_path)
  e.update(DRY_RUN="1", **env)
  r = subprocess.run(
    ["/bin/bash", str(root / script), *args],
    env=e,
    cwd=str(root),
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 0, r.stderr
  return r.stdout


def _pinned_jax(root=ROOT):
  # The CPU pin (Python < 3.12; an environment marker may follow it).
  return re.search(r"^jax==([^\s;]+)", (root / "requirements.txt").read_text(), re.M).group(1)


_INSTALLS = {  # script, the arguments of a dry run that sets up its venv, jax's extra
  "launch/tpu_pod.sh": (["--name", "t", "--zone", "z", "--workdir", "gs://b/run"], "tpu"),
  "launch/gpu_slurm.sbatch": (["--workdir", "/shared/run", "--setup"], "cuda12"),
  "launch/gpu_multinode.sh": (["--workdir", "/shared/run", "--setup"], "cuda12"),
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("checkout", ["this", "another pin"])
def test_scripts_install_the_platform_jax_extra_at_the_requirements_pin(script, checkout, tmp_path):
  """What each script pip-installs is jax[tpu] / jax[cuda12] at requirements.txt's jax
  pin: this checkout's, and in a copy whose requirements.txt pins another version (the
  scripts read it; none writes a version of its own)."""
  root = ROOT
  if checkout != "this":
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "launch", root / "launch")
    (root / "main.py").touch()
    text = (ROOT / "requirements.txt").read_text()
    (root / "requirements.txt").write_text(re.sub(r"(?m)^jax==[^\s;]+", "jax==9.8.7", text))
  args, extra = _INSTALLS[script]
  out = _dry_run(script, args, tmp_path, root=root).replace("\\", "")
  installs = re.findall(r"pip install -q (jax\[\w+\]==\S+) -r requirements.txt", out)
  assert installs == [f"jax[{extra}]=={_pinned_jax(root)}"], out
  if checkout != "this":
    assert _pinned_jax(root) == "9.8.7"
  assert not re.search(r"jax\[\w+\]==\d", (root / script).read_text())


def test_tpu_dry_run_passes_overrides(tmp_path):
  out = _dry_run(
    "launch/tpu_pod.sh",
    [
      "--name",
      "t",
      "--zone",
      "us-central2-b",
      "--workdir",
      "gs://b/run",
      "--skip_setup",
      "--config.seed=7",
      "--",
      "--config.mesh.shape=1,-1,1",
    ],
    tmp_path,
  )
  assert "tpu-vm ssh t --zone us-central2-b --worker=all" in out
  assert "main.py" in out and "gs://b/run" in out
  assert "--config.seed=7" in out and "--config.mesh.shape=1" in out


def test_slurm_dry_run(tmp_path):
  out = _dry_run(
    "launch/gpu_slurm.sbatch", ["--workdir", "/shared/run", "--", "--config.seed=3"], tmp_path
  )
  assert "srun --nodes=1 --ntasks-per-node=1" in out
  assert "--workdir=/shared/run" in out and "--config.seed=3" in out


def test_multinode_dry_run_process_ids(tmp_path):
  out = _dry_run(
    "launch/gpu_multinode.sh",
    [
      "--workdir",
      "/shared/run",
      "--num_nodes",
      "2",
      "--node_rank",
      "1",
      "--coordinator",
      "n0:1234",
      "--procs_per_node",
      "4",
      "--gpus_per_node",
      "4",
      "--config.seed=3",
    ],
    tmp_path,
  )
  lines = [l for l in out.strip().splitlines() if "JAX_PROCESS_ID" in l]
  assert len(lines) == 4
  for local, line in enumerate(lines):
    assert f"JAX_PROCESS_ID={4 + local} " in line
    assert f"JAX_LOCAL_DEVICE_IDS={local} " in line
    assert "JAX_NUM_PROCESSES=8" in line and "JAX_COORDINATOR_ADDRESS=n0:1234" in line
    assert line.endswith("--config.seed=3")


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_their_flags_with_common_sh(script):
  """One parser for every script: each declares its flags and calls common.sh's."""
  text = (ROOT / script).read_text()
  assert 'parse_args "$@"' in text and "OPTIONS=(" in text
  assert "while [[ $# -gt 0 ]]" not in text and "need()" not in text


def _usage_flags(script, tmp_path):
  """[(flag, takes a value)] of the options block of `script --help`."""
  out = subprocess.run(
    ["/bin/bash", str(ROOT / script), "--help"],
    env=_offline_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=20,
    check=True,
  ).stdout
  return [
    (m.group(1), bool(m.group(2)))
    for m in re.finditer(r"(?m)^  (--\w+)(?: ([A-Z][A-Z0-9:_]*))?\s", out)
  ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_documented_flag_is_parsed(script, tmp_path):
  """Each flag --help lists is one the script's parser knows: given before --help it
  is consumed (an unknown one would end the run with exit 2 before --help)."""
  flags = _usage_flags(script, tmp_path)
  assert ("--workdir", True) in flags and ("--dry_run", False) in flags, flags
  for flag, value in flags:
    args = [f"{flag}=x"] if value else [flag]
    r = subprocess.run(
      ["/bin/bash", str(ROOT / script), *args, "--help"],
      env=_offline_env(tmp_path),
      capture_output=True,
      text=True,
      timeout=20,
    )
    assert r.returncode == 0 and "usage" in r.stdout.lower(), (flag, r.stderr)


def _parse(*args):
  """common.sh's parse_args on `args` with a flag of each kind (value, switch, exported
  value) beside the common ones; returns the CompletedProcess, whose stdout is
  A|B|E as a child process sees it|CONFIG|WORKDIR|DRY_RUN|EXTRA..., one per line."""
  script = textwrap.dedent(f"""\
      set -euo pipefail
      source {ROOT}/launch/common.sh
      PROG=t
      usage() {{ echo "usage: t"; }}
      A=a0 B=0 CONFIG=c0 WORKDIR= DATA_DIR= DRY_RUN=0
      OPTIONS=("${{COMMON_OPTIONS[@]}}" --a=A --b=B=1 --e=+E)
      parse_args "$@"
      printf '%s\\n' "$A" "$B" "$(/bin/bash -c 'echo "${{E:-unset}}"')" "$CONFIG" \\
          "$WORKDIR" "$DRY_RUN" "${{EXTRA[@]}}"
      """)
  return subprocess.run(
    ["/bin/bash", "-c", script, "t", *args], capture_output=True, text=True, timeout=20
  )


@pytest.mark.parametrize(
  "args,expected",
  [
    ([], ["a0", "0", "unset", "c0", "", "0"]),
    (
      ["--a", "x y", "--b", "--e", "v", "--workdir=/w", "--dry_run"],
      ["x y", "1", "v", "c0", "/w", "1"],
    ),
    (
      ["--a=k=v", "--config.seed=3", "--config", "f.py", "--", "--a", "--config.x=1"],
      ["k=v", "0", "unset", "f.py", "", "0", "--config.seed=3", "--a", "--config.x=1"],
    ),
  ],
)
def test_parse_args_sets_values_switches_exports_and_passes_the_rest(args, expected):
  r = _parse(*args)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split("\n")[:-1] == expected


@pytest.mark.parametrize(
  "args,error",
  [
    (["--a"], "t: --a needs a value"),
    (["--a", ""], "t: --a needs a value"),
    (["--b=1"], "t: unknown argument '--b=1' (see --help)"),
    (["--zz", "--a", "x"], "t: unknown argument '--zz' (see --help)"),
    (["--configs=x"], "t: unknown argument '--configs=x' (see --help)"),
  ],
)
def test_parse_args_misuse_is_one_line_exit_2(args, error):
  r = _parse(*args)
  assert (r.returncode, r.stderr, r.stdout) == (2, error + "\n", "")


def test_parse_args_help_prints_usage_and_stops():
  r = _parse("--a", "x", "-h", "--zz")
  assert (r.returncode, r.stdout) == (0, "usage: t\n")


def test_tpu_pod_compiles_for_the_slice_before_creating_it(tmp_path):
  """The pre-flight (odetransformer.memory --compile_for=<accelerator>, with the run's
  --config.* overrides) comes before any gcloud command; --skip_preflight drops it; a
  slice the compiler cannot describe (v4) is said to be skipped."""
  args = ["--name", "t", "--zone", "z", "--workdir", "gs://b/run", "--skip_setup"]
  out = _dry_run(
    "launch/tpu_pod.sh",
    [*args, "--accelerator", "v5p-128", "--config.seed=7", "--", "--config.mesh.shape=1,-1,1"],
    tmp_path,
  ).replace("\\", "")
  lines = out.splitlines()
  pre = next(i for i, line in enumerate(lines) if "odetransformer.memory" in line)
  assert "--config=configs/owt_small.py --compile_for=v5p-128 --config.seed=7" in lines[pre]
  assert "--config.mesh.shape=1,-1,1" in lines[pre]
  assert pre < next(i for i, line in enumerate(lines) if "gcloud" in line)
  out = _dry_run(
    "launch/tpu_pod.sh", [*args, "--accelerator", "v5p-128", "--skip_preflight"], tmp_path
  )
  assert "odetransformer.memory" not in out
  out = _dry_run("launch/tpu_pod.sh", [*args, "--accelerator", "v4-8"], tmp_path)
  assert "odetransformer.memory" not in out and "no compile target for v4-8" in out


def _failing_preflight(tmp_path):
  """A stand-in for the pre-flight's python: the one line a config that does not fit
  ends with, exit 2 (what odetransformer.memory does), and a mark that it ran."""
  fake = tmp_path / "python"
  fake.write_text(
    "#!/bin/bash\n"
    f'echo "$*" > {tmp_path}/ran\n'
    'echo "error: does not fit: 20.00 GiB per chip of v5e-16, 16 GiB there" >&2\n'
    "exit 2\n"
  )
  fake.chmod(0o755)
  return fake


def test_tpu_pod_refuses_a_config_that_does_not_fit(tmp_path):
  """Not a dry run: the refusal comes before gcloud is called (there is none here)."""
  r = subprocess.run(
    [
      "/bin/bash",
      str(ROOT / "launch/tpu_pod.sh"),
      "--name=t",
      "--zone=z",
      "--workdir=gs://b/run",
      "--accelerator=v5e-16",
      f"--python={_failing_preflight(tmp_path)}",
    ],
    env=_offline_env(tmp_path),
    cwd=str(ROOT),
    capture_output=True,
    text=True,
    timeout=30,
  )
  assert r.returncode == 2, r.stdout + r.stderr
  assert "--compile_for=v5e-16" in (tmp_path / "ran").read_text()
  err = r.stderr.strip().splitlines()
  assert err[-2].startswith("error: does not fit")
  assert err[-1].startswith("tpu_pod.sh: refusing to launch: the pre-flight for v5e-16 failed")
  assert "gcloud" not in r.stdout + r.stderr


def test_multinode_hosts_compile_once_for_the_whole_cluster(tmp_path):
  out = _dry_run(
    "launch/gpu_multinode.sh",
    ["--workdir", "/shared/run", "--hosts", "n0,n1", "--gpus_per_node", "8"],
    tmp_path,
  )
  assert out.count("odetransformer.memory") == 1 and "--compile_for=h100x16" in out
  ssh = [line for line in out.splitlines() if line.startswith("+ ssh")]
  assert len(ssh) == 2 and all("--skip_preflight" in line for line in ssh)
  # One node started by hand compiles for the cluster it is part of.
  out = _dry_run(
    "launch/gpu_multinode.sh",
    ["--workdir", "/shared/run", "--num_nodes", "8", "--gpus_per_node", "8"],
    tmp_path,
  )
  assert "--compile_for=h100x64" in out
