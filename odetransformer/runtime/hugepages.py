"""Transparent huge pages for XLA:CPU's buffers, opt-in: `ODET_HUGEPAGES=1`.

    ODET_HUGEPAGES=1 python main.py --config=configs/default.py --workdir=/tmp/odet_default

With the switch on, and only on a CPU run, main.py (and the benchmarks) re-execute the
process once with glibc's `glibc.malloc.hugetlb=1` tunable, before jax is imported.

Why: XLA:CPU allocates a train step's temporaries afresh at every step. glibc serves
blocks of 32 MiB and more with their own mmap, so each step first-touches
them again, one 4 KiB page fault at a time. With the tunable (glibc ≥ 2.35), glibc marks
its mappings MADV_HUGEPAGE and the kernel faults 2 MiB pages instead: same losses, bit
for bit, in less time (the command above with and without the switch; the figures are in
benchmarks/README.md, Huge pages).

glibc reads tunables only when a process starts, hence the re-exec (same PID, same
arguments). It happens only when all of these hold:

- `ODET_HUGEPAGES=1` (unset or 0: off, the default; any other value is an error);
- this is a CPU host (`odetransformer/runtime/host.py`: no GPU or TPU device, and JAX_PLATFORMS
  unset or `cpu`). Accelerator hosts never re-execute: a step's buffers live on the
  device there, and the process a launcher started stays as it started;
- GLIBC_TUNABLES is not set (your own tunables are kept as they are);
- Linux with glibc ≥ 2.35 and transparent huge pages in `madvise` mode (`always`
  needs no request; `never` cannot be asked).
"""

from collections.abc import Mapping
import os
import sys

from odetransformer.errors import UserError
from odetransformer.runtime import host

SWITCH = "ODET_HUGEPAGES"
TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def opted_in(environ: Mapping[str, str]) -> bool:
  """Whether ODET_HUGEPAGES asks for huge pages (a value other than 1, 0 or '' is an error)."""
  value = environ.get(SWITCH, "").strip()
  if value not in ("", "0", "1"):
    raise UserError(
      f"{SWITCH}={value!r} is not a switch value; set {SWITCH}=1 for huge "
      "pages on CPU, or 0 (the default) for none"
    )
  return value == "1"


def _glibc_version() -> tuple | None:
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    return tuple(int(p) for p in version.split(".")[:2]) if name == "glibc" else None
  except (AttributeError, ValueError, OSError):
    return None


def _thp_mode() -> str:
  """'always', 'madvise' or 'never' (the bracketed word of the sysfs file); '' if unknown."""
  try:
    with open(_THP_MODE) as f:
      text = f.read()
  except OSError:
    return ""
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else ""


def reason_not_to(
  environ: Mapping[str, str], thp_mode: str, glibc: tuple | None, accelerators: list
) -> str:
  """Why there is no re-exec in this environment and machine state ('' when there is one).

  `accelerators`: `host.accelerator_devices()`; see the module docstring for the rules.
  """
  if not opted_in(environ):
    return f"{SWITCH} is not 1"
  if accelerators:
    return f"this host has accelerators ({', '.join(accelerators[:3])})"
  if not host.cpu_host(environ, accelerators):
    return f"JAX_PLATFORMS={','.join(host.jax_platforms(environ))} is not a CPU run"
  if "GLIBC_TUNABLES" in environ:
    return "GLIBC_TUNABLES is already set"
  if glibc is None or glibc < (2, 35):
    return "it needs glibc 2.35 or later"
  if thp_mode != "madvise":
    return f"transparent huge pages are {thp_mode!r}, not 'madvise'"
  return ""


def reason_not_here() -> str:
  """`reason_not_to` for this process on this machine ('' when it re-executes)."""
  if not opted_in(os.environ):  # the default: nothing else is looked at
    return f"{SWITCH} is not 1"
  return reason_not_to(os.environ, _thp_mode(), _glibc_version(), host.accelerator_devices())


def reexec_with_huge_pages() -> None:
  """Replaces this process by itself with the tunable set (returns if nothing to do)."""
  if reason_not_here():
    return
  env = dict(os.environ, GLIBC_TUNABLES=TUNABLE)
  args = getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv  # 3.10+: with -X, -m
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    # sys.executable, not args[0]: a bare "python" could resolve outside the venv.
    os.execve(sys.executable, [sys.executable] + args[1:], env)
  except OSError:
    pass  # cannot re-exec (no executable path): carry on with 4 KiB pages
