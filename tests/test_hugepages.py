"""The huge-page re-exec (odetransformer/runtime/hugepages.py) and the CPU-host test it relies on
(odetransformer/runtime/host.py): off by default, on when opted in on a CPU host, never on a
GPU/TPU host; when it happens it keeps the process, and large host buffers are then
really backed by huge pages."""

import os
import pathlib
import subprocess
import sys

import pytest

from odetransformer import errors
from odetransformer.runtime import host, hugepages

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Prints its pid and GLIBC_TUNABLES on every (re)start, re-execs (as on a GPU host when
# argv[1] is "gpu"), then mallocs and touches 256 MB (plain malloc, as XLA's allocator:
# numpy would madvise its own buffers) and prints the AnonHugePages of
# /proc/self/smaps_rollup.
_CHILD = """
import ctypes, os, sys
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
from odetransformer.runtime import host, hugepages
if sys.argv[1:] == ["gpu"]:
  host.accelerator_devices = lambda root="/": ["/dev/nvidia0"]
hugepages.reexec_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
buf = libc.malloc(256 << 20)
ctypes.memset(buf, 1, 256 << 20)
kb = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print("after", os.getpid(), os.environ.get("GLIBC_TUNABLES") or "-", kb[0] if kb else -1)
"""

ON = {"ODET_HUGEPAGES": "1"}
GPU = ["/dev/nvidia0"]


@pytest.mark.parametrize(
  "environ, mode, glibc, accelerators, expect",
  [
    ({}, "madvise", (2, 36), [], "ODET_HUGEPAGES is not 1"),  # off by default
    ({"ODET_HUGEPAGES": "0"}, "madvise", (2, 36), [], "ODET_HUGEPAGES is not 1"),
    (ON, "madvise", (2, 36), [], ""),  # opted in, CPU host
    (ON, "madvise", (2, 35), [], ""),
    (dict(ON, JAX_PLATFORMS="cpu"), "madvise", (2, 36), [], ""),
    (ON, "madvise", (2, 36), GPU, "this host has accelerators (/dev/nvidia0)"),
    (ON, "madvise", (2, 36), ["/dev/accel0"], "this host has accelerators (/dev/accel0)"),
    (dict(ON, JAX_PLATFORMS="cpu"), "madvise", (2, 36), GPU, "this host has accelerators"),
    (dict(ON, JAX_PLATFORMS="tpu"), "madvise", (2, 36), [], "JAX_PLATFORMS=tpu is not a CPU"),
    (dict(ON, JAX_PLATFORMS="cuda,cpu"), "madvise", (2, 36), [], "JAX_PLATFORMS=cuda,cpu"),
    (ON, "madvise", (2, 31), [], "glibc 2.35"),  # tunable unknown before 2.35
    (ON, "always", (2, 36), [], "'always'"),  # huge pages without asking
    (ON, "never", (2, 36), [], "'never'"),
    (ON, "", (2, 36), [], "''"),  # no sysfs file (not Linux, or a container)
    (ON, "madvise", None, [], "glibc"),  # not glibc
    (dict(ON, GLIBC_TUNABLES=""), "madvise", (2, 36), [], "GLIBC_TUNABLES"),  # the user's own
    (dict(ON, GLIBC_TUNABLES="glibc.malloc.arena_max=2"), "madvise", (2, 36), [], "GLIBC_TUNABLES"),
  ],
)
def test_when_to_reexec(environ, mode, glibc, accelerators, expect):
  reason = hugepages.reason_not_to(dict(environ, PATH="/bin"), mode, glibc, accelerators)
  if expect:
    assert expect in reason
  else:
    assert reason == ""


@pytest.mark.slow
@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_bad_switch_value_is_a_one_line_error(value):
  with pytest.raises(errors.UserError, match=r"ODET_HUGEPAGES=.* set ODET_HUGEPAGES=1"):
    hugepages.opted_in({"ODET_HUGEPAGES": value})
  r = subprocess.run(
    [sys.executable, "main.py", "--config=configs/default.py", "--workdir=x"],
    cwd=ROOT,
    env=dict(os.environ, ODET_HUGEPAGES=value),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2
  assert r.stderr.splitlines() == [
    f"error: ODET_HUGEPAGES={value!r} is not a switch value; "
    "set ODET_HUGEPAGES=1 for huge pages on CPU, or 0 (the "
    "default) for none"
  ]


@pytest.mark.parametrize(
  "files, expect",
  [
    ([], []),
    (["dev/null", "dev/vfio/vfio", "dev/dri/card0"], []),  # a CPU VM's usual devices
    (["dev/nvidia0", "dev/nvidiactl"], ["dev/nvidia0", "dev/nvidiactl"]),
    (["dev/nvidiactl"], ["dev/nvidiactl"]),  # Docker with the runtime's devices
    (["dev/dxg"], ["dev/dxg"]),  # WSL2
    (["dev/kfd"], ["dev/kfd"]),  # AMD ROCm
    (["dev/accel0", "dev/accel1"], ["dev/accel0", "dev/accel1"]),  # TPU v2–v4
    (["dev/vfio/vfio", "dev/vfio/0"], ["dev/vfio/0"]),  # TPU v5e and later
  ],
)
def test_accelerator_device_files(tmp_path, files, expect):
  for f in files:
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).touch()
  assert host.accelerator_devices(str(tmp_path)) == [str(tmp_path / f) for f in expect]


def _pci(root, slot, vendor, pci_class):
  d = root / "sys/bus/pci/devices" / slot
  d.mkdir(parents=True)
  (d / "vendor").write_text(vendor + "\n")
  (d / "class").write_text(pci_class + "\n")
  return str(d)


def test_a_google_tpu_chip_on_pci_is_an_accelerator(tmp_path):
  _pci(tmp_path, "0000:00:04.0", "0x1ae0", "0x020000")  # gVNIC network card
  _pci(tmp_path, "0000:00:05.0", "0x1ae0", "0x010802")  # Persistent Disk NVMe
  _pci(tmp_path, "0000:00:06.0", "0x8086", "0x120000")  # not Google
  assert host.accelerator_devices(str(tmp_path)) == []
  tpu = _pci(tmp_path, "0000:00:07.0", "0x1ae0", "0xff0000")
  assert host.accelerator_devices(str(tmp_path)) == [tpu]


def test_default_to_cpu_only_on_a_cpu_host_without_a_platform_choice(tmp_path):
  env = {}
  assert host.default_to_cpu(env, root=str(tmp_path)) and env == {"JAX_PLATFORMS": "cpu"}
  for chosen in ("", "cuda", "tpu,cpu"):  # the user's choice, even empty
    env = {"JAX_PLATFORMS": chosen}
    assert not host.default_to_cpu(env, root=str(tmp_path)) and env["JAX_PLATFORMS"] == chosen
  (tmp_path / "dev").mkdir()
  (tmp_path / "dev" / "nvidia0").touch()
  env = {}
  assert not host.default_to_cpu(env, root=str(tmp_path)) and env == {}


def _run(env, *args):
  out = subprocess.run(
    [sys.executable, "-c", _CHILD, *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  ).stdout.split("\n")
  return [line.split() for line in out if line]


def _env(**extra):
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("GLIBC_TUNABLES", "ODET_HUGEPAGES", "JAX_PLATFORMS")
  }
  return dict(env, **extra)


def _no_reexec(lines):
  assert [line[0] for line in lines] == ["start", "after"], lines
  assert lines[0][1] == lines[1][1] and lines[1][2] == "-"
  return int(lines[1][3])


@pytest.mark.slow
def test_off_by_default():
  """No switch: no re-exec, and malloc'd buffers keep 4 KiB pages (the contrast that makes
  the huge-page assertion below meaningful)."""
  kb = _no_reexec(_run(_env()))
  if hugepages._thp_mode() == "madvise":
    assert kb < 128 << 10


@pytest.mark.slow
def test_opted_in_on_a_cpu_host_reexecs_the_same_process_with_huge_pages():
  env = _env(ODET_HUGEPAGES="1")
  lines = _run(env)
  pid = lines[0][1]
  assert lines[0] == ["start", pid, "None"]
  reason = hugepages.reason_not_to(
    env, hugepages._thp_mode(), hugepages._glibc_version(), host.accelerator_devices()
  )
  if reason:
    _no_reexec(lines)
    pytest.skip(f"no re-exec on this machine: {reason}")
  # Restarted once, as the same process (a launcher's SIGTERM still reaches it).
  assert lines[1] == ["start", pid, hugepages.TUNABLE]
  after = lines[2]
  assert after[:3] == ["after", pid, hugepages.TUNABLE]
  assert int(after[3]) >= 128 << 10, f"huge pages back only {after[3]} kB of the 256 MB buffer"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["device", "JAX_PLATFORMS"])
def test_never_on_an_accelerator_host(how):
  if how == "device":  # the child sees a /dev/nvidia0
    lines = _run(_env(ODET_HUGEPAGES="1"), "gpu")
  else:
    lines = _run(_env(ODET_HUGEPAGES="1", JAX_PLATFORMS="cuda"))
  _no_reexec(lines)
