"""Save and restore time of a checkpoint with and without its integrity checks.

"with integrity" saves the checkpoint's four items through the training code's handlers
(`odetransformer.train.checkpoint.integrity`): arrays as zarr3 with a crc32c per chunk,
each item's other files hashed into integrity.json before the commit; the restore
checks the records, and tensorstore every chunk's crc32c. "orbax default" is the same
save and restore through orbax's standard handlers (zarr2, no checksum of the data).
"+ sha256" adds what the previous design did on process 0: a synchronous sha256 of every
file after the save and again before the restore.

The state: model + Adam moments (mu, nu) of float32 normal random values (weights do
not compress), as 1-device CPU arrays; async save, timed to the commit. Variants
alternate within each repeat; medians are printed, of wall time and of the process's
CPU time (all threads: the work done, which other jobs on a shared machine disturb
less than the wall time). A restore reads what its save wrote just before (the page
cache holds it, for every variant alike).

  python -m benchmarks.checkpoint_integrity                 # 1 GiB state, 3 repeats
  python -m benchmarks.checkpoint_integrity --gib=0.01 --repeats=1   # seconds (tests)

Last line: `integrity overhead: save R×, restore R× (target ≤ 1.10)`.
"""

import contextlib
import functools
import os
import statistics
import tempfile
import time

from flax import nnx
import jax
import numpy as np
import orbax.checkpoint as ocp

from odetransformer import cli_flags, errors
from odetransformer.runtime import fileio
from odetransformer.runtime.logs import quiet_library_logs
from odetransformer.train.checkpoint.integrity import (
  ArraysRestore,
  ArraysSave,
  JsonRestore,
  JsonSave,
  files_under,
  integrity_item_handlers,
  verify_integrity_record,
)
from odetransformer.train.checkpoint.paths import checkpoint_dir

ARRAYS_PER_PART = 16  # model, mu and nu: 16 arrays each


def make_states(gib: float, seed: int = 0):
  """(model, opt) nnx.States of float32 arrays, `gib` GiB together."""
  per_array = max(1024, int(gib * 2**30 / (3 * ARRAYS_PER_PART * 4)))
  cols = 1024
  rows = max(1, per_array // cols)
  rng = np.random.default_rng(seed)

  def part():
    return {
      f"w{i}": jax.device_put(rng.standard_normal((rows, cols), dtype=np.float32))
      for i in range(ARRAYS_PER_PART)
    }

  model = nnx.State({"params": part()})
  opt = nnx.State({"mu": part(), "nu": part(), "count": jax.device_put(np.int32(7))})
  return model, opt


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class Timer:
  """Wall and process CPU seconds of the `with` blocks it times (`measure`)."""

  def __init__(self):
    self.wall, self.cpu = [], []

  @contextlib.contextmanager
  def measure(self):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    self.wall.append(time.perf_counter() - wall)
    self.cpu.append(time.process_time() - cpu)


def _sha256_all(step_dir: str):
  for rel in files_under(step_dir):
    fileio.sha256(fileio.join(step_dir, rel))


def save_and_restore(
  workdir, model, opt, save: Timer, restore: Timer, *, integrity: bool, sha256: bool = False
):
  """One save and one restore of the checkpoint's four items: with `integrity`
  through the training code's handlers (and the record checked before the restore),
  else through orbax's standard ones; with `sha256`, the old design's hash of every
  file after the save and before the restore."""
  handlers = integrity_item_handlers() if integrity else None
  save_arrays = ArraysSave if integrity else ocp.args.StandardSave
  save_json = JsonSave if integrity else ocp.args.JsonSave
  step_dir = fileio.join(checkpoint_dir(workdir), "1")
  mngr = ocp.CheckpointManager(
    checkpoint_dir(workdir),
    item_handlers=handlers,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=1, create=True, enable_async_checkpointing=True
    ),
  )
  with save.measure():
    mngr.save(
      1,
      args=ocp.args.Composite(
        model=save_arrays(nnx.to_pure_dict(model)),
        opt=save_arrays(nnx.to_pure_dict(opt)),
        meta=save_json({"note": "benchmark"}),
        data=save_json({"states": [{"position": 0}]}),
      ),
    )
    mngr.wait_until_finished()
    if sha256:
      _sha256_all(step_dir)
  targets = {"model": nnx.to_pure_dict(abstract(model)), "opt": nnx.to_pure_dict(abstract(opt))}
  if integrity:
    args = {
      item: ArraysRestore(item=t, restore_args=ocp.checkpoint_utils.construct_restore_args(t))
      for item, t in targets.items()
    }
    args.update(meta=JsonRestore(), data=JsonRestore())
  else:
    args = {item: ocp.args.StandardRestore(t) for item, t in targets.items()}
    args.update(meta=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
  with restore.measure():
    if sha256:
      _sha256_all(step_dir)
    if integrity:
      for item in args:
        verify_integrity_record(fileio.join(step_dir, item))
    restored = mngr.restore(1, args=ocp.args.Composite(**args))
    jax.block_until_ready((restored["model"], restored["opt"]))
  mngr.close()


VARIANTS = {
  "orbax default": functools.partial(save_and_restore, integrity=False),
  "with integrity": functools.partial(save_and_restore, integrity=True),
  "+ sha256 (old)": functools.partial(save_and_restore, integrity=False, sha256=True),
}


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("float", "gib", 1.0, "state size in GiB")
  define("integer", "repeats", 3, "save and restore rounds of every variant")
  define("string", "dir", "", "where to write (default: a temporary directory on the local disk)")


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  quiet_library_logs()
  model, opt = make_states(args.gib)
  nbytes = sum(x.nbytes for x in jax.tree.leaves((model, opt)))
  print(
    f"state {nbytes / 2**30:.2f} GiB ({len(jax.tree.leaves((model, opt)))} float32 "
    f"arrays), {args.repeats} repeat(s), median seconds"
  )
  timers = {name: (Timer(), Timer()) for name in VARIANTS}
  with tempfile.TemporaryDirectory(dir=args.dir or None) as root:
    for r in range(args.repeats):
      for i, name in enumerate(VARIANTS if r % 2 == 0 else reversed(VARIANTS)):
        workdir = os.path.join(root, f"{r}-{i}")
        VARIANTS[name](workdir, model, opt, *timers[name])
        fileio.rmtree(workdir)
  base = "orbax default"
  print(
    f"{'':16s}"
    + "".join(f"{name:>16s}" for name in VARIANTS)
    + f"{'integrity/orbax':>17s}{'sha256/orbax':>14s}"
  )
  ratios = {}
  for i, what in enumerate(("save", "restore")):
    for kind in ("wall", "cpu"):
      med = {name: statistics.median(getattr(timers[name][i], kind)) for name in VARIANTS}
      ratios[what, kind] = med["with integrity"] / med[base]
      print(
        f"{what + ' ' + kind + ' s':16s}"
        + "".join(f"{med[n]:16.2f}" for n in VARIANTS)
        + f"{ratios[what, kind]:16.2f}×{med['+ sha256 (old)'] / med[base]:13.2f}×"
      )
  print(
    f"integrity overhead: save {ratios['save', 'wall']:.2f}×, restore "
    f"{ratios['restore', 'wall']:.2f}× wall; save {ratios['save', 'cpu']:.2f}×, restore "
    f"{ratios['restore', 'cpu']:.2f}× CPU (target ≤ 1.10)"
  )


if __name__ == "__main__":
  errors.run_cli(main)
