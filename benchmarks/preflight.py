"""The pre-flight's table: owt configs compiled for a TPU slice and H100 clusters on a CPU.

For each config (owt_small, owt_medium, owt_large as they are), model (DiffEqFormer, GPT)
and target, `odetransformer.memory`'s `memory_report(target=...)` compiles the real train
and eval steps for the target with its own compiler (requirements-compile.txt) and the
row gives: the compiled peak per chip, the planner's analytic estimate and their ratio,
collective bytes per step (and the DiffEqFormer's over the GPT's), the compile time, and
on TPU the compiler's estimated step time and MFU. Each row is written to `--json` as it
ends; a rerun skips the rows already there (a long table resumes).

  python -m benchmarks.preflight --json=$HOME/preflight.json
  python -m benchmarks.preflight --configs=owt_small --targets=v5e-16 --json=/tmp/p.json
  python -m benchmarks.preflight --json=$HOME/preflight.json --replan  # the planner anew
"""

import sys

from odetransformer.tools import compile_targets  # imports no jax

# Before jax: as odetransformer.memory --compile_for sets it up (TPU and H100 targets).
if getattr(sys.modules["__main__"].__spec__, "name", "") == "benchmarks.preflight":
  compile_targets.compile_only_environment(("tpu", "cuda"))

import importlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

from odetransformer import cli_flags, errors  # noqa: E402
from odetransformer.tools import memory  # noqa: E402

KINDS = ("diffeqformer", "transformer")
GIB = 2**30


def define_flags(define) -> None:
  define(
    "string", "configs", "owt_small,owt_medium,owt_large", "configs/<name>.py, comma-separated"
  )
  define("string", "targets", "v5e-256,h100x8,h100x64", "compile targets, comma-separated")
  define("string", "json", "", "rows go here as they end; rows already there are skipped")
  define(
    "bool",
    "replan",
    False,
    "recompute the planner's estimate of the rows already in --json (no compiling)",
  )


def _config(config_name: str, kind: str):
  config = importlib.import_module(f"configs.{config_name}").get_config()
  config.model.kind = kind
  return config


def planned_gib(r: dict) -> float:
  """The planner's (analytic) total for a row, on its target's devices."""
  target = compile_targets.parse(r["target"])
  report = memory.memory_report(
    _config(r["config"], r["kind"]),
    compile_step=False,
    devices=compile_targets.devices(target),
    device_memory_gib=target.memory_gib,
  )
  return report.total_bytes / GIB


def row(config_name: str, kind: str, target_name: str) -> dict:
  config = _config(config_name, kind)
  target = compile_targets.parse(target_name)
  r = memory.memory_report(config, target=target)
  return {
    "config": config_name,
    "kind": kind,
    "target": target_name,
    "params": r.num_params,
    "peak_gib": r.total_bytes / GIB,
    "estimate_gib": r.estimate_bytes / GIB,
    "fits": r.fits,
    "eval_gib": r.eval_bytes / GIB,
    "collective_gb": sum(r.hlo["weighted"].values()) / 1e9,
    "collectives": r.hlo,
    "compile_s": r.compile_seconds,
    "step_ms": r.step_seconds * 1e3,
    "mfu": r.mfu,
  }


def table(rows: list) -> str:
  gpt = {(r["config"], r["target"]): r for r in rows if r["kind"] == "transformer"}
  out = [
    "| config | model | target | peak / chip | planner | ratio | collectives / step | "
    "ODE/GPT | compile | step (TPU est.) | MFU |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    g = gpt.get((r["config"], r["target"]))
    ratio = f"{r['collective_gb'] / g['collective_gb']:.2f}" if g and r is not g else ""
    step, mfu = (f"{r['step_ms']:.0f} ms", f"{100 * r['mfu']:.0f}%") if r["step_ms"] else ("", "")
    out.append(
      f"| {r['config']} | {'GPT' if r['kind'] == 'transformer' else 'DiffEqFormer'} | "
      f"{r['target']} | {r['peak_gib']:.2f} GiB{'' if r['fits'] else ' (DOES NOT FIT)'} | "
      f"{r['estimate_gib']:.2f} GiB | {r['peak_gib'] / r['estimate_gib']:.2f} | "
      f"{r['collective_gb']:.1f} GB | {ratio} | {r['compile_s']:.0f} s | "
      f"{step} | {mfu} |"
    )
  return "\n".join(out)


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  path = pathlib.Path(args.json) if args.json else None
  rows = json.loads(path.read_text()) if path and path.exists() else []
  if args.replan:
    for r in rows:
      r["estimate_gib"] = planned_gib(r)
    if path:
      path.write_text(json.dumps(rows, indent=1))
  done = {(r["config"], r["kind"], r["target"]) for r in rows}
  for target in filter(None, args.targets.split(",")):
    for config_name in filter(None, args.configs.split(",")):
      for kind in KINDS:
        if (config_name, kind, target) in done:
          continue
        rows.append(row(config_name, kind, target))
        r = rows[-1]
        print(
          f"{config_name} {kind} {target}: {r['peak_gib']:.2f} GiB per chip "
          f"(planner {r['estimate_gib']:.2f}), {r['collective_gb']:.1f} GB collectives, "
          f"compile {r['compile_s']:.0f} s",
          flush=True,
        )
        if path:
          path.write_text(json.dumps(rows, indent=1))
  print(table(rows))
  return rows


if __name__ == "__main__":
  errors.run_cli(main)
