r"""lm-evaluation-harness with odetransformer checkpoints.

  python -m odetransformer.lm_eval --model odetransformer \
      --model_args workdir=W,solver_steps=N --tasks TASK [--include_path DIR] \
      [--batch_size 8] [--limit 100] [--output_path OUT]

The harness's own `lm_eval` command cannot see project models: this entry point
imports `odetransformer.tools.lm_eval_model` (which registers the model class under the name
'odetransformer') and then runs the harness's CLI (`lm_eval.__main__.cli_evaluate`)
in the same process, with the same arguments. Needs the optional dependencies in
requirements-eval.txt. Model arguments: see odetransformer/tools/lm_eval_model.py. A user
error of ours (a workdir without a run, checkpoints that do not restore) is one line on
stderr and exit status 2 (`--verbose` for the traceback).

Under several processes (a pod slice: `jax.distributed`, initialised as main.py does)
every process runs the harness on the same requests, the model sharded over all of
them (model_args mesh_shape=1;-1;1 or the run's mesh); only process 0 prints and
writes (`--output_path`, `--log_samples` are dropped on the others).
"""

import multiprocessing
import os
import sys

from odetransformer import errors
from odetransformer.runtime import host

# Harness options that write results; only process 0 keeps them (flag -> takes a value).
_WRITING_OPTIONS = {
  "--output_path": True,
  "-o": True,
  "--log_samples": False,
  "-s": False,
  "--wandb_args": True,
  "--hf_hub_log_args": True,
}


def without_writing_options(argv: list) -> list:
  """`argv` without the harness options that write files or upload results."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.split("=", 1)[0]
    if name in _WRITING_OPTIONS:
      skip = _WRITING_OPTIONS[name] and "=" not in arg
      continue
    out.append(arg)
  return out


def main() -> None:
  # The harness bootstraps stderrs in a multiprocessing pool; forking a process that
  # runs JAX (multithreaded) can deadlock, so its workers are spawned instead.
  try:
    multiprocessing.set_start_method("spawn")
  except RuntimeError:  # already set by the caller
    pass
  if host.initialize_distributed():  # before anything touches a device
    import jax  # lazy: only a multi-process run needs jax here

    if jax.process_index() != 0:  # same work, no output: process 0 reports
      sys.argv = without_writing_options(sys.argv)
      sys.stdout = open(os.devnull, "w")  # open for the rest of the process
  try:
    from lm_eval.__main__ import cli_evaluate  # lazy: the harness is an optional dependency

    # Registers the model with the harness (hence the noqa); imports the harness too.
    from odetransformer.tools import lm_eval_model  # noqa: F401
  except ModuleNotFoundError as e:
    if e.name and e.name.split(".")[0] == "lm_eval":
      raise errors.UserError(
        "lm-evaluation-harness is not installed; fix: pip install -r requirements-eval.txt"
      ) from e
    raise
  # The harness parses sys.argv itself and knows no --verbose: take ours out first.
  sys.argv = [a for a in sys.argv if a not in ("--verbose", "--noverbose")]
  cli_evaluate()


if __name__ == "__main__":
  errors.run_cli(main, argv=list(sys.argv))
