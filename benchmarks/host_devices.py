"""`XLA_FLAGS` for N fake host CPU devices; call before jax creates its backends (the
benchmarks that compile for a mesh of 8 devices on one CPU do, when run as programs).
Apart from common.py, the other shared module, because that one imports jax."""

import os
import re


def force_host_devices(num: int) -> None:
  flags = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
  ).strip()
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
