r"""lm-evaluation-harness with odetransformer checkpoints.

  python -m odetransformer.lm_eval --model odetransformer \
      --model_args workdir=W,num_steps=N --tasks TASK [--include_path DIR] \
      [--batch_size 8] [--limit 100] [--output_path OUT]

The harness's own `lm_eval` command cannot see project models: this entry point
imports `odetransformer.lm_eval_model` (which registers the model class under the name
'odetransformer') and then runs the harness's CLI (`lm_eval.__main__.cli_evaluate`)
in the same process, with the same arguments. Needs the optional dependencies in
requirements-eval.txt. Model arguments: see odetransformer/lm_eval_model.py.
"""
import multiprocessing
import sys


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
      print("error: lm-evaluation-harness is not installed; fix: "
            "pip install -r requirements-eval.txt", file=sys.stderr)
      sys.exit(2)
    raise
  cli_evaluate()


if __name__ == "__main__":
  main()
