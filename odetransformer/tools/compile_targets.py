"""Accelerators to compile for on a machine without them: TPU slices and H100 clusters.

XLA's TPU and CUDA compilers run on a CPU host: `jax.experimental.topologies` describes a
slice (TPU: libtpu's topology by name; GPU: a target config text proto, here the H100
SXM's, and `slices x hosts x GPUs per host`) and returns compile-only devices to build a
mesh on. Nothing runs; `jax.jit(...).lower(...).compile()` gives the per-chip program, its
memory (`memory_analysis()`) and its HLO (`hlo_stats`).

Names follow the cloud's: `v5e-N` (also `v5litepod-N`) is N v5e chips; `v5p-N` is N
TensorCores, N/2 chips (each chip one megacore device); `h100xN` is N H100 SXM GPUs, 8 a
host. The compilers come from requirements-compile.txt (libtpu, the CUDA plugin, cuDNN);
the process must run with JAX_PLATFORMS=cpu (`odetransformer.memory --compile_for` sets
it before jax loads).
"""

import dataclasses
import math
import os
import pathlib
import re

from odetransformer import errors

GIB = 1024**3
H100_TARGET = pathlib.Path(__file__).resolve().parent / "targets" / "h100_sxm.txtpb"
INSTALL = "pip install -r requirements-compile.txt (the TPU and CUDA compilers, ~2.9 GB)"


@dataclasses.dataclass(frozen=True)
class Target:
  """One slice to compile for."""

  name: str  # as given, e.g. v5e-256
  platform: str  # 'tpu' | 'cuda'
  topology: str  # libtpu's 'v5e:16x16' or the GPU's 'slices x hosts x GPUs per host'
  chips: int
  memory_gib: float  # HBM per chip
  peak_flops: float  # bf16 dense FLOP/s per chip (odetransformer.train.metrics' table)
  # TPU: the core clock that turns the compiler's estimated cycles into seconds (the bf16
  # peak over the chip's MXU multiply-adds per cycle: 4 (v5e) or 8 (v5p) MXUs of 128 x 128).
  clock_hz: float = 0.0
  hosts: int = 1  # GPU: hosts of 8


# Chip shapes of the slice sizes libtpu names (v5e/v6e: 2D tori; v5p: 3D).
_SHAPES_2D = {
  1: "1x1",
  4: "2x2",
  8: "2x4",
  16: "4x4",
  32: "4x8",
  64: "8x8",
  128: "8x16",
  256: "16x16",
}
_SHAPES_3D = {
  4: "2x2x1",
  8: "2x2x2",
  16: "2x2x4",
  32: "2x4x4",
  64: "4x4x4",
  128: "4x4x8",
  256: "4x8x8",
  512: "8x8x8",
}
_TPU = {  # generation -> (libtpu's name, TensorCores a name counts per chip, shapes, GiB,
  #                        bf16 FLOP/s per chip, MXU multiply-adds per cycle)
  "v5e": ("v5e", 1, _SHAPES_2D, 16.0, 197e12, 4 * 128 * 128),
  "v5litepod": ("v5e", 1, _SHAPES_2D, 16.0, 197e12, 4 * 128 * 128),
  "v5p": ("v5p", 2, _SHAPES_3D, 95.0, 459e12, 8 * 128 * 128),
}
H100_MEMORY_GIB = 80.0
H100_PEAK_FLOPS = 989e12
GPUS_PER_HOST = 8

_OFF_TPU_VM = {
  "TPU_SKIP_MDS_QUERY": "1",
  "TPU_ACCELERATOR_TYPE": "v5litepod-1",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
EXAMPLES = "v5e-16, v5e-256, v5p-128, h100x8, h100x64"


def parse(name: str) -> Target:
  """The `Target` a name like `v5e-256`, `v5p-128` or `h100x64` stands for; a UserError
  naming the names it knows otherwise."""
  m = re.fullmatch(r"h100x(\d+)", name)
  if m:
    n = int(m.group(1))
    if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
      raise errors.UserError(
        f"--compile_for={name}: an H100 cluster is up to 8 GPUs or a multiple of 8 "
        f"(8 a host), e.g. h100x8 or h100x64"
      )
    hosts = max(1, n // GPUS_PER_HOST)
    return Target(
      name,
      "cuda",
      f"1x{hosts}x{min(n, GPUS_PER_HOST)}",
      n,
      H100_MEMORY_GIB,
      H100_PEAK_FLOPS,
      hosts=hosts,
    )
  m = re.fullmatch(r"(v5e|v5litepod|v5p)-(\d+)", name)
  if m and m.group(1) in _TPU:
    gen, per_chip, shapes, gib, peak, macs = _TPU[m.group(1)]
    chips = int(m.group(2)) // per_chip
    if chips in shapes and int(m.group(2)) % per_chip == 0:
      return Target(
        name, "tpu", f"{gen}:{shapes[chips]}", chips, gib, peak, clock_hz=peak / (2 * macs)
      )
    sizes = ", ".join(f"{m.group(1)}-{c * per_chip}" for c in shapes)
    raise errors.UserError(f"--compile_for={name}: no such slice; {m.group(1)} comes as {sizes}")
  raise errors.UserError(f"--compile_for={name}: unknown target; one of {EXAMPLES}")


def compile_only_environment(platforms) -> None:
  """Before jax is imported: compile-only devices need jax on its CPU platform (no driver
  probe); for an H100, every matmul a cuBLAS call, as autotuning picks on one at these
  sizes (no Triton GEMM, untuned without a GPU). `platforms`: those compiled for."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "cuda" in platforms:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"
    ).strip()


def cuda_devices(target_config: str, topology: str) -> list:
  """Compile-only GPUs of a target config text proto (`slices x hosts x GPUs per host`),
  with jax's cuDNN check answering for them (`answer_cudnn_for`)."""
  from jax.experimental import topologies  # lazy: only when compiling for a GPU

  devs = list(
    topologies.get_topology_desc(
      platform="cuda", topology=topology, target_config=target_config
    ).devices
  )
  answer_cudnn_for(devs[0])
  return devs


def devices(target: Target) -> list:
  """Compile-only devices of `target` (no hardware needed); a UserError saying what to
  install when its compiler is missing."""
  from jax.experimental import topologies  # lazy: only when compiling for a target

  try:
    if target.platform == "tpu":
      import libtpu  # noqa: F401  (the TPU compiler; a clear error before jax's)

      # Off a TPU VM, libtpu asks the cloud's metadata server which slice it is on and
      # writes four lines of warnings when none answers: say it is a lone host. These
      # describe this process, not the slice compiled for (its topology name does). And
      # a compiler drives no chip: other processes may load libtpu at the same time (it
      # takes a lock file otherwise, and a second process fails).
      for key, value in _OFF_TPU_VM.items():
        os.environ.setdefault(key, value)
      devs = list(
        topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices
      )
    else:
      import jax_plugins.xla_cuda12  # noqa: F401  (the CUDA compiler)

      devs = cuda_devices(H100_TARGET.read_text(), target.topology)
  except ImportError:
    raise errors.UserError(
      f"compiling for {target.name} needs the {target.platform.upper()} compiler, which "
      f"is not installed; {INSTALL}"
    ) from None
  except Exception as e:  # noqa: BLE001 (one line for any plugin failure)
    raise errors.UserError(
      f"cannot make the compile target {target.name} "
      f"({str(e).strip().splitlines()[0][:160]}); run with JAX_PLATFORMS=cpu and {INSTALL}"
    ) from None
  if len(devs) != target.chips:
    raise errors.UserError(
      f"--compile_for={target.name}: the compiler made {len(devs)} devices, expected {target.chips}"
    )
  return devs


def answer_cudnn_for(device) -> None:
  """jax's cuDNN attention checks the compute capability of its default backend (this
  host's CPU), not of the GPU compiled for: answer for `device`'s."""
  from jax._src.cudnn import fused_attention_stablehlo  # lazy: the CUDA path only

  capability = tuple(int(x) for x in device.compute_capability.split("."))
  fused_attention_stablehlo.check_compute_capability = lambda cc: (
    capability >= tuple(int(x) for x in cc.split("."))
  )


def step_seconds(target: Target, cycles: int) -> float:
  """The compiler's estimate of a step on one TPU chip, from its kernels' cycles."""
  return cycles / target.clock_hz if target.clock_hz else math.nan
