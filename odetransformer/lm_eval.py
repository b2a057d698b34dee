r"""lm-evaluation-harness with odetransformer checkpoints.

  python -m odetransformer.lm_eval --model odetransformer \
      --model_args workdir=W,num_steps=N --tasks TASK [--include_path DIR] \
      [--batch_size 8] [--limit 100] [--output_path OUT]

The harness's own `lm_eval` command cannot see project models: this entry point
imports `odetransformer.lm_eval_model` (which registers the model class under the name
'odetransformer') and then runs the harness's CLI (`lm_eval.__main__.cli_evaluate`)
in the same process, with the same arguments. Needs the optional dependencies in
requirements-eval.txt. Model arguments: see odetransformer/lm_eval_model.py. A user
error of ours (a workdir without a run, checkpoints that do not restore) is one line on
stderr and exit status 2 (`--verbose` for the traceback).
"""
import multiprocessing
import sys

from odetransformer import errors


def main() -> None:
  # The harness bootstraps stderrs in a multiprocessing pool; forking a process that
  # runs JAX (multithreaded) can deadlock, so its workers are spawned instead.
  try:
    multiprocessing.set_start_method("spawn")
  except RuntimeError:  # already set by the caller
    pass
  try:
    from odetransformer import lm_eval_model  # pylint: disable=g-import-not-at-top,unused-import
    from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    if e.name and e.name.split(".")[0] == "lm_eval":
      raise errors.UserError("lm-evaluation-harness is not installed; fix: "
                             "pip install -r requirements-eval.txt") from e
    raise
  # The harness parses sys.argv itself and knows no --verbose: take ours out first.
  sys.argv = [a for a in sys.argv if a not in ("--verbose", "--noverbose")]
  cli_evaluate()


if __name__ == "__main__":
  errors.run_cli(main, argv=list(sys.argv))
