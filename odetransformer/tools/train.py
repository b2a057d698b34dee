"""Trains (or resumes) a model from a config file.

  python main.py --config=configs/default.py --workdir=/tmp/odet_default
      [--config.model.solver_steps=12 ...] [--verbose]

(`odet-train` with the same flags once the package is installed; main.py, in the
repository root, runs this module.)

Every mistake of the user's — a bad flag, config file or value, bad data settings, a
workdir that is a file, read-only, in use by another run or holding checkpoints of
another model, tokenizer or data, checkpoints none of which restores, a failed save, a
diverged (NaN/inf) run, a shape that does not fit the device's memory — prints one line
to stderr and exits with status 2 (add --verbose for the traceback); such errors are
found before anything is written to the workdir, or leave its checkpoints as they were.
Exit status: 0 when the run reached num_train_steps; 2 for a user's mistake (above); 75
when SIGTERM or Ctrl-C stopped it early after saving a checkpoint at the current step
(EX_TEMPFAIL of sysexits.h: not finished, run the same command again to resume it; a
scheduler or babysitter tells it from a finished run by this status); 130 when a second
Ctrl-C ends it at once, without saving. A run killed outright resumes from its newest
complete checkpoint when started again with the same command.

On a machine without GPU or TPU, JAX_PLATFORMS=cpu is set unless you set JAX_PLATFORMS
yourself (JAX then skips probing accelerator runtimes). ODET_HUGEPAGES=1 makes a CPU run
faster on Linux (benchmarks/README.md, Huge pages): the process re-executes itself once
with glibc's huge-page tunable (odetransformer/runtime/hugepages.py says when; off by
default, never on GPU/TPU hosts).

Multi-host runs call `jax.distributed.initialize()` when the environment says there are
several processes (JAX_COORDINATOR_ADDRESS, a SLURM or Open MPI job of several tasks, a
multi-host Cloud TPU slice); on a single host nothing is initialised. A hand-made launch
on N hosts:

  JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i python main.py ...
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from odetransformer import cli_flags, errors
from odetransformer.runtime import host, hugepages
from odetransformer.runtime.logs import quiet_library_logs

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "Experiment config file, e.g. configs/default.py; override any of its "
  "keys with --config.<key>=<value>.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Directory for checkpoints, logs and the tokenizer."
)
flags.DEFINE_bool(
  "verbose",
  False,
  "Show the traceback of a user error (bad flag, config, "
  "data or workdir) as well as its one-line message.",
)
flags.mark_flags_as_required(["config", "workdir"])

_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?", "h")
_cpu_by_default = False  # whether this process set JAX_PLATFORMS=cpu (host.default_to_cpu)


def _parse_flags(argv: list) -> list:
  """`cli_flags.parse_absl_flags`, where a request for help exits 0 (absl's help exits 1)
  and -h means --help."""
  argv = [("--help" if arg == "-h" else arg) for arg in argv]
  try:
    return cli_flags.parse_absl_flags(argv)
  except SystemExit as e:
    asked = any(arg.lstrip("-") in _HELP_FLAGS for arg in argv[1:] if arg.startswith("-"))
    if e.code == 1 and asked:
      raise SystemExit(0) from None
    raise


def main(argv):
  if len(argv) > 1:
    raise errors.UserError(
      f"unexpected arguments {argv[1:]}; flags take the form --name=value (see --helpshort)"
    )
  config = cli_flags.load_config_flag(_CONFIG)
  quiet_library_logs()  # orbax and TFDS: warnings and errors only
  import jax  # lazy: after flag parsing (grain workers read absl flags) and JAX_PLATFORMS

  if _cpu_by_default:
    logging.info(
      "no GPU or TPU device found: running on CPU (JAX_PLATFORMS=cpu; set "
      "JAX_PLATFORMS yourself to choose)"
    )
  host.initialize_distributed()  # several processes: jax.distributed (host.py)
  logging.info(
    "JAX process %d/%d, %d local / %d global devices (%s)",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
    jax.devices()[0].device_kind,
  )
  if os.environ.get("GLIBC_TUNABLES") == hugepages.TUNABLE:
    logging.info("GLIBC_TUNABLES=%s: host buffers use transparent huge pages", hugepages.TUNABLE)
  elif hugepages.opted_in(os.environ):
    logging.info("%s=1 has no effect here: %s", hugepages.SWITCH, hugepages.reason_not_here())

  from odetransformer.tools import out_of_memory  # lazy: imports jax (see above)
  from odetransformer.train import loop  # lazy: after flag parsing (grain workers read absl flags)

  try:
    result = loop.train_and_evaluate(config, _WORKDIR.value)  # a UserError: one line (run_cli)
  except errors.UserError:
    raise
  except Exception as e:  # XLA out of memory: one line too
    oom = out_of_memory.out_of_memory_error(e, config)
    if oom is None:
      raise
    raise oom from e
  # app.run exits with main's return value: 0 (None) for a finished run.
  return errors.EXIT_STOPPED_EARLY if result.get("preempted") else None


def _run():
  global _cpu_by_default
  hugepages.reexec_with_huge_pages()  # before jax is imported; see hugepages.py
  _cpu_by_default = host.default_to_cpu()
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  errors.run_cli(_run)  # a bad ODET_HUGEPAGES value is a UserError too
