"""The huge-page re-exec (odetransformer/hugepages.py): when it happens, that it keeps the
process, and that large host buffers then really are backed by huge pages."""
import os
import pathlib
import subprocess
import sys

import pytest

from odetransformer import hugepages

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Prints its pid and GLIBC_TUNABLES on every (re)start, re-execs, then mallocs and touches
# 256 MB (plain malloc, as XLA's allocator: numpy would madvise its own buffers) and
# prints the AnonHugePages of /proc/self/smaps_rollup.
_CHILD = f"""
import ctypes, os, sys
sys.path.insert(0, {str(ROOT)!r})
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
from odetransformer import hugepages
hugepages.reexec_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
buf = libc.malloc(256 << 20)
ctypes.memset(buf, 1, 256 << 20)
kb = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print("after", os.getpid(), os.environ.get("GLIBC_TUNABLES") or "-", kb[0] if kb else -1)
"""


@pytest.mark.parametrize("environ, mode, glibc, expect", [
    ({}, "madvise", (2, 36), True),
    ({}, "madvise", (2, 35), True),
    ({}, "madvise", (2, 31), False),      # tunable unknown before 2.35
    ({}, "always", (2, 36), False),       # huge pages without asking
    ({}, "never", (2, 36), False),
    ({}, "", (2, 36), False),             # no sysfs file (not Linux, or a container)
    ({}, "madvise", None, False),         # not glibc
    ({"GLIBC_TUNABLES": ""}, "madvise", (2, 36), False),   # the user's opt-out
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36), False),
])
def test_when_to_reexec(environ, mode, glibc, expect):
  env = hugepages.env_with_huge_pages(dict(environ, PATH="/bin"), mode, glibc)
  if expect:
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": hugepages.TUNABLE}
  else:
    assert env is None


def _run(env):
  out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split("\n")
  return [line.split() for line in out if line]


def test_reexec_keeps_the_process_and_backs_big_buffers_with_huge_pages():
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  lines = _run(env)
  pid = lines[0][1]
  assert lines[0] == ["start", pid, "None"]
  if hugepages.env_with_huge_pages(env, hugepages._thp_mode(),
                                   hugepages._glibc_version()) is None:
    assert [line[:3] for line in lines[1:]] == [["after", pid, "-"]]
    pytest.skip(f"no re-exec on this machine (THP mode {hugepages._thp_mode()!r})")
  # Restarted once, as the same process (a launcher's SIGTERM still reaches it).
  assert lines[1] == ["start", pid, hugepages.TUNABLE]
  after = lines[2]
  assert after[:3] == ["after", pid, hugepages.TUNABLE]
  assert int(after[3]) >= 128 << 10, f"huge pages back only {after[3]} kB of the 256 MB buffer"


def test_opt_out_with_own_tunables():
  """GLIBC_TUNABLES set (here empty): no re-exec, and malloc'd buffers keep 4 KiB pages
  (the contrast that makes the huge-page assertion above meaningful)."""
  lines = _run(dict(os.environ, GLIBC_TUNABLES=""))
  assert [line[0] for line in lines] == ["start", "after"]
  assert lines[0][1] == lines[1][1]
  if hugepages._thp_mode() == "madvise":
    assert int(lines[1][3]) < 128 << 10
