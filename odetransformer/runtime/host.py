"""Whether this run is on CPU, decided before jax is imported (stdlib only).

JAX picks its platform when it first initialises its backends; by then it is too late
to re-execute the process (odetransformer/runtime/hugepages.py) or to spare a CPU machine the
probing of accelerator runtimes that are installed but have no device. So this module
answers from what the operating system shows:

- An accelerator is present if any of these exists (the files JAX itself looks for,
  plus TPU ones): NVIDIA `/dev/nvidia0`, `/dev/nvidiactl`, WSL2 `/dev/dxg`; AMD
  `/dev/kfd`; TPU v2–v4 `/dev/accel*`, TPU v5 and later `/dev/vfio/<group>`; or a
  Google PCI device that is not a disk, network card or bridge (a TPU chip).
- A CPU host has none of them, and a `JAX_PLATFORMS` that is unset or names only `cpu`.

A false "accelerator" only costs a CPU machine the two conveniences below; a missed
one is what must not happen, hence the broad list.

`initialize_distributed` is the multi-host start every command shares (main.py and the
downstream tools): `jax.distributed.initialize()` when the environment says this is one
of several processes, nothing on a single host.
"""

from collections.abc import Mapping
import glob
import os

_DEVICE_FILES = (
  "dev/nvidia0",
  "dev/nvidiactl",
  "dev/dxg",
  "dev/kfd",
  "dev/accel*",
  "dev/vfio/[0-9]*",
)
_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI base classes that are not accelerators: mass storage, network, bridge.
_NOT_ACCELERATOR_CLASSES = ("0x01", "0x02", "0x06")


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def accelerator_devices(root: str = "/") -> list:
  """Paths (under `root`) of the GPU / TPU devices this machine has; [] on a CPU machine."""
  found = []
  for pattern in _DEVICE_FILES:
    found += sorted(glob.glob(os.path.join(root, pattern)))
  for vendor in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
    device = os.path.dirname(vendor)
    pci_class = _read(os.path.join(device, "class"))
    if _read(vendor) == _GOOGLE_PCI_VENDOR and not pci_class.startswith(_NOT_ACCELERATOR_CLASSES):
      found.append(device)
  return found


def jax_platforms(environ: Mapping[str, str]) -> list:
  """The platforms `JAX_PLATFORMS` names ([] when unset or empty: JAX chooses)."""
  return [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]


def cpu_host(environ: Mapping[str, str], accelerators: list) -> bool:
  """No GPU/TPU device (`accelerators` is `accelerator_devices()`), and JAX_PLATFORMS
  unset or naming only `cpu`."""
  return not accelerators and set(jax_platforms(environ)) <= {"cpu"}


def default_to_cpu(environ=None, root: str = "/") -> bool:
  """Sets JAX_PLATFORMS=cpu when it is unset and the machine has no GPU or TPU.

  JAX then initialises its CPU backend only, instead of probing every installed runtime
  (a TPU runtime on a CPU machine queries cloud metadata and warns). A GPU/TPU host, or
  a JAX_PLATFORMS set by the user (even empty), is left alone. Returns whether it set it.
  """
  environ = os.environ if environ is None else environ
  if "JAX_PLATFORMS" in environ or accelerator_devices(root):
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  return True


def multi_process_env(environ: Mapping[str, str] = None) -> bool:
  """True when a launcher says this is one of several processes (single host: False).

  Recognised: JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID unless
  a cluster below supplies them), SLURM and Open MPI jobs of more than one task, and
  multi-host Cloud TPU slices. JAX's own cluster detection then fills in the rest.
  """
  env = os.environ if environ is None else environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if env.get(key, "1").isdigit() and int(env.get(key, "1")) > 1:
      return True
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  return "," in hosts or bool(env.get("MEGASCALE_COORDINATOR_ADDRESS"))


def distributed_args(environ: Mapping[str, str] = None) -> dict:
  """num_processes / process_id from JAX_NUM_PROCESSES / JAX_PROCESS_ID, when set."""
  env = os.environ if environ is None else environ
  args = {}
  for key, name in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
    if env.get(key, "").isdigit():
      args[name] = int(env[key])
  return args


def initialize_distributed() -> bool:
  """`jax.distributed.initialize()` when this is one of several processes (see
  `multi_process_env`); call it before anything touches a JAX device. Idempotent.
  Returns whether this is a multi-process job."""
  if not multi_process_env():
    return False
  import jax  # lazy: this module decides things before jax is imported (stdlib only)

  if not jax.distributed.is_initialized():
    jax.distributed.initialize(**distributed_args())
  return True
