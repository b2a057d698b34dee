"""Out of device memory as one line: what XLA could not allocate against the device's
memory, the planner's estimate for the config (`odetransformer.memory`), and what to
change.

`main.py` passes every exception of a training run through `out_of_memory_error`: XLA
running out of memory (anywhere in the exception's chain) becomes a `UserError`, so
the run ends with `error: out of memory ...` and exit 2 instead of a traceback. Nothing
is written on the way out: the newest checkpoint stays the newest.
"""

import re

import jax

from odetransformer import errors
from odetransformer.tools import memory

GIB = 1 << 30
_BYTES = (
  re.compile(r"allocat\w* (\d+) bytes"),
  re.compile(r"\((\d+)B\)"),
  re.compile(r"(\d+) bytes"),
)


def find_out_of_memory(e: BaseException) -> BaseException | None:
  """XLA's out-of-memory error in `e`'s chain (causes and contexts), or None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, jax.errors.JaxRuntimeError) and memory.is_out_of_memory(str(e)):
      return e
    e = e.__cause__ or e.__context__
  return None


def requested_bytes(message: str) -> int | None:
  """The size of the allocation that failed, from XLA's message (None if it names none)."""
  for pattern in _BYTES:
    found = pattern.search(message)
    if found:
      return int(found.group(1))
  return None


def _gib(n) -> str:
  return f"{n / GIB:,.1f} GiB"


def _planned_bytes(config, device_memory_gib: float) -> int | None:
  """The analytic planner's per-device total for `config`, or None where it cannot say."""
  try:
    return memory.memory_report(
      config, compile_step=False, device_memory_gib=device_memory_gib
    ).total_bytes
  except Exception:  # the line is worth more than the plan
    return None


def out_of_memory_error(e: BaseException, config, device=None) -> errors.UserError | None:
  """`e` as a one-line UserError when it is XLA running out of memory, else None."""
  oom = find_out_of_memory(e)
  if oom is None:
    return None
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  requested = requested_bytes(str(oom))
  what = (
    f"XLA could not allocate {_gib(requested)}"
    if requested is not None
    else "XLA could not allocate a buffer"
  )
  if limit:
    where = f"with {_gib(stats.get('bytes_in_use', 0))} of the device's {_gib(limit)} in use"
  else:
    where = "(the device reports no memory limit: host memory)"
  planned = _planned_bytes(config, limit / GIB if limit else 80.0)
  plan = (
    f"the planner estimates {_gib(planned)} per device for this config "
    "(python -m odetransformer.memory --config=...)"
    if planned is not None
    else "python -m odetransformer.memory --config=... plans it"
  )
  name = (
    device.platform
    if device.device_kind == device.platform
    else f"{device.device_kind} ({device.platform})"
  )
  return errors.UserError(
    f"out of memory on {name}: {what} {where}; {plan}; {memory.advice(config)}"
  )
