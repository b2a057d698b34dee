"""The collectives reader (odetransformer.tools.hlo_stats) against hand-built programs, and
benchmarks/collectives.py's run.

Both run in one subprocess with 8 host devices (XLA_FLAGS must be set before jax loads);
the bad mesh runs the benchmark as a program (`python -m benchmarks.collectives`).
"""

import json
import math
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from configs import default as default_config
from odetransformer.model import config as config_lib

from tiny import cpu_env

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
  return cpu_env()  # the scripts ask for their 8 devices themselves


_PARSER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from odetransformer.tools.hlo_stats import parse_step as parse_collectives

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    # One all-gather of a [64, 32] f32 array split over 8 devices.
    gather = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, whole),
                     in_shardings=split)
    once = gather.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)).compile().as_text()

    # The same gather of a [16, 8] slice, inside a loop of 5 trips.
    def looped(a):
      def body(i, acc):
        row = jax.lax.dynamic_slice_in_dim(a, i * 16, 16)       # [16, 8], split over x
        row = jax.lax.with_sharding_constraint(row * 1.5, split)
        return acc + jax.lax.with_sharding_constraint(row, whole)
      return jax.lax.fori_loop(0, 5, body, jnp.zeros((16, 8), a.dtype))
    loop = jax.jit(looped, in_shardings=NamedSharding(mesh, P(None, None)))
    text = loop.lower(jax.ShapeDtypeStruct((80, 8), jnp.float32)).compile().as_text()
    print(json.dumps({"once": parse_collectives(once), "loop": parse_collectives(text),
                      "loop_gathers": text.count(" all-gather(")}), flush=True)

    # Then the benchmark at its tiny shape on the mesh that splits the parameters two
    # ways at once, in the same process (its 8 devices are these).
    from benchmarks import collectives
    collectives.main(["--tiny", "--meshes=1,2,4"])
""")


@pytest.fixture(scope="module")
def parser_and_benchmark():
  """(the parser script's JSON, the benchmark's stdout) of one process on 8 host devices:
  one start-up (jax with 8 devices) for both tests."""
  proc = subprocess.run(
    [sys.executable, "-c", _PARSER_SCRIPT, str(ROOT)],
    env=_env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  _, marker, rest = proc.stdout.partition('{"once": ')
  assert marker, proc.stdout[-2000:]
  parsed, _, benchmark = (marker + rest).partition("\n")
  return json.loads(parsed), benchmark


@pytest.mark.xdist_group("collectives")
def test_parser_counts_a_known_all_gather_exactly_and_weights_loops(parser_and_benchmark):
  out = parser_and_benchmark[0]
  once = out["once"]
  assert once["static"]["all-gather"] == 64 * 32 * 4  # the gathered f32[64, 32]
  assert once["weighted"] == once["static"]  # no loop
  assert sum(once["static"].values()) == 64 * 32 * 4  # nothing else moves
  loop = out["loop"]
  assert out["loop_gathers"] >= 1 and loop["unknown_trip_counts"] == 0
  per_trip = 16 * 8 * 4
  assert loop["static"]["all-gather"] == out["loop_gathers"] * per_trip
  assert loop["weighted"]["all-gather"] == 5 * loop["static"]["all-gather"]


@pytest.mark.xdist_group("collectives")
def test_collectives_benchmark_at_tiny_shape(parser_and_benchmark):
  """Also `odetransformer.tools.memory`'s analytic estimate: within ±15% of each compiled
  step's per-device peak (both models and families). On the mesh that splits the
  parameters two ways at once, (1, 2, 4): fsdp and tensor; the benchmark's default also
  runs (1, 8, 1) and (2, 4, 1), whose data axis tests/test_sharding.py covers. (Its
  main, in the parser script's process; test_collectives_benchmark_rejects_a_bad_mesh
  runs it as a program.)"""
  out = parser_and_benchmark[1]
  rows = re.findall(
    r"^\((\d), (\d), (\d)\)\s+(gpt2|llama)\s+(transformer|diffeqformer|\+ local error)\s.*\s"
    r"([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)$",
    out,
    re.MULTILINE,
  )
  # meshes × families × models: GPT, the DiffEqFormer without the local error penalty, and
  # as configs/default.py trains it (the penalty on)
  assert default_config.get_config().model.local_error_weight > 0
  assert len(rows) == 1 * 2 * 3, out
  estimates = [float(est) / float(peak) for *_, peak, est in rows]
  assert all(0.85 <= e <= 1.15 for e in estimates), out
  m = re.search(
    r"^odetransformer.tools.memory estimate / compiled peak: from ([0-9.]+) to "
    r"([0-9.]+) over 6 steps$",
    out,
    re.MULTILINE,
  )
  assert m, out
  # The rows print MiB to 0.1: each row's true ratio lies within these bounds, so the
  # printed (unrounded) smallest and largest lie within the bounds' smallest and largest.
  low = [(float(est) - 0.05) / (float(peak) + 0.05) for *_, peak, est in rows]
  high = [(float(est) + 0.05) / (float(peak) - 0.05) for *_, peak, est in rows]
  assert min(low) - 0.0005 <= float(m.group(1)) <= min(high) + 0.0005, out
  assert max(low) - 0.0005 <= float(m.group(2)) <= max(high) + 0.0005, out
  ratios = [float(r) for r in re.findall(r"ratio ode/gpt: collective bytes ([0-9.]+)", out)]
  assert len(ratios) == 2
  last = out.strip().splitlines()[-1]
  m = re.fullmatch(r"diffeqformer/gpt collective bytes: max ratio ([0-9.]+|inf) over meshes", last)
  assert m, last
  r = float(m.group(1))
  assert math.isfinite(r) and r == max(ratios)
  assert r <= 1.10, out  # the ODE moves what GPT moves (its generated W, not its P)
  # The penalty's E more field evaluations (of K = 2; E = 2 under configs/default.py's
  # local_error_form='both') move at most E more evaluations' generated weights: up to
  # (K + E) / K of the K evaluations' bytes, less the part (the embeddings') that is not
  # the layers'.
  form = default_config.get_config().model.local_error_form
  evaluations = config_lib.ModelConfig(local_error_form=form).local_error_evaluations
  extra = [
    float(r) for r in re.findall(r"\+ local error / diffeqformer: collective bytes ([0-9.]+)", out)
  ]
  assert len(extra) == 2 and all(1.0 < e <= (2 + evaluations) / 2 for e in extra), out
  m = re.search(
    rf"^local error penalty: collective bytes up to ([0-9.]+) × the K = 2 evaluations' "
    rf"without it \({evaluations} more evaluation\(s\)': ([0-9.]+)\)$",
    out,
    re.M,
  )
  assert m and float(m.group(1)) == max(extra), out
  assert float(m.group(2)) == (2 + evaluations) / 2, out


def test_collectives_benchmark_rejects_a_bad_mesh():
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks.collectives", "--tiny", "--meshes=3,3,1"],
    env=_env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "--meshes" in lines[0], proc.stderr
