"""A gs:// workdir works like a local one, against a GCS emulator.

A run on `gs://<bucket>/run` (stopped, its newest checkpoint corrupted, then continued by
main.py) is checked against an uninterrupted local run, then read by the tools; the
corrupt checkpoint on gs:// falls back; the lock refuses a second run. The data cache
stays local (data.cache_dir). No local directory named `gs:` may appear anywhere."""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import tempfile

from absl import flags
from absl import logging as absl_logging
import ml_collections
import numpy as np
import pytest
from test_reliability import STEPS, config, main_cmd, subprocess_env
from test_train import ROOT, fast_compiles  # noqa: F401  (fast_compiles: autouse fixture, the rbg PRNG)

from odetransformer.analysis import lyapunov, spectra
from odetransformer.runtime import fileio
from odetransformer.runtime.workdir_lock import WorkdirInUseError, WorkdirLock
from odetransformer.tools import evaluate, generate
from odetransformer.train import loop
from odetransformer.train import metrics as metrics_lib
from odetransformer.train.checkpoint.paths import finalized_steps

pytestmark = [
  pytest.mark.xdist_group("test_gcs"),  # module fixtures once, on one worker
  pytest.mark.slow,
]
# The runs here are STEPS long, as test_reliability's: the train step compiled for that
# length (the session's persistent cache, conftest) serves them all.


@pytest.fixture(scope="module")
def cache(shared_data_cache):
  """The tokenizer/data cache of every run of this module: the session's (conftest)."""
  return shared_data_cache


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory):
  """An uninterrupted local run (in-process): its workdir, {step: train loss} and final
  eval loss."""
  wd = tmp_path_factory.mktemp("gcs_reference")
  result = loop.train_and_evaluate(config(cache, STEPS), str(wd))
  return wd, dict(result["loss_history"]), result["eval"]["loss"]


def flip_a_weight_byte(step_dir: str):
  """Flips one byte of a weight file of the checkpoint at `step_dir` (on any storage)."""
  # The largest data file holds the arrays' chunks (others may hold b-tree nodes that a
  # read does not open).
  names = [f for f in fileio.walk_files(step_dir) if f.startswith("model/ocdbt.process_0/d/")]
  target, data = max(
    (
      (fileio.join(step_dir, n), bytearray(fileio.read_bytes(fileio.join(step_dir, n))))
      for n in names
    ),
    key=lambda item: len(item[1]),
  )
  data[len(data) // 2] ^= 0xFF
  fileio.write_bytes_atomic(target, bytes(data))


@pytest.fixture(scope="module")
def gs_run(gcs_bucket, cache):
  """A run on gs:// with a checkpoint every 2 steps, stopped at step 3 (here:
  `stop_at_step`, which saves there; test_multihost stops one on gs:// with a real
  SIGTERM); a byte of the newest checkpoint's weights flipped; then main.py with the same
  config (falls back to the previous checkpoint, 2). Returns (workdir, the stopped step,
  main.py's stderr)."""
  wd = f"{gcs_bucket}/run"
  stopped = 3
  first = loop.train_and_evaluate(config(cache, STEPS), wd, stop_at_step=stopped)
  assert (first["step"], finalized_steps(wd)) == (stopped, [2, 3])
  flip_a_weight_byte(fileio.join(wd, "checkpoints", str(stopped)))
  second = subprocess.run(
    main_cmd(wd, cache, STEPS),
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert second.returncode == 0, second.stderr[-3000:]
  return wd, stopped, second.stderr


def _no_local_gs_dir():
  """Nowhere a local directory named like the URL's scheme: cwd, the repo, the tmp dir."""
  for root in {pathlib.Path.cwd(), ROOT, pathlib.Path(tempfile.gettempdir())}:
    assert not (root / "gs:").exists(), root


def test_gs_run_falls_back_resumes_exactly_and_writes_nothing_local(gs_run, reference):
  """The corrupt newest checkpoint moved aside, the previous one resumed: every step's
  loss equals the uninterrupted local run's."""
  wd, stopped, err = gs_run
  assert f"moved the corrupt checkpoint of step {stopped} to {wd}/corrupt_checkpoints/" in err, err[
    -3000:
  ]
  assert f"resumed from checkpoint at step {stopped - 1} in {wd}/checkpoints" in err
  assert finalized_steps(wd)[-1] == STEPS
  for name in ("config.json", "tokenizer.model"):
    assert fileio.isfile(fileio.join(wd, name)), name
  assert not fileio.exists(fileio.join(wd, ".lock"))  # released at the end
  # TensorBoard on gs://: both runs' losses, equal to the uninterrupted run's.
  losses = dict(metrics_lib.read_scalars(fileio.join(wd, "tensorboard"))["train/loss"])
  assert sorted(losses) == list(range(1, STEPS + 1))
  for step, loss in losses.items():
    assert np.float32(loss) == np.float32(reference[1][step]), (step, loss)
  _no_local_gs_dir()


def _tool(command, workdir, *args) -> str:
  """What `command`'s main (its flags, in this process: the storage is what is tested)
  prints for `workdir`, its name and timings replaced."""
  fv = command.define_flags(flags.FlagValues())
  fv([command.__name__, f"--workdir={workdir}", *args])
  verbosity = absl_logging.get_verbosity()  # (the tools lower it)
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      command.main([], fv)
  finally:
    absl_logging.set_verbosity(verbosity)
  return [
    re.sub(r"\d+\.\d+s\b", "TIME", l.replace(workdir, "WORKDIR"))
    for l in out.getvalue().splitlines()
  ]


def test_evaluate_and_generate_read_gs_like_local(gs_run, reference):
  """evaluate on the gs:// run prints what it prints on the local reference (the same
  weights: the resume was exact), apart from the workdir's name and timings; generate
  reads its model and tokenizer from gs:// too."""
  wd, local = gs_run[0], str(reference[0])
  outputs = {w: _tool(evaluate, w, "--max_batches=1") for w in (wd, local)}
  outputs["generate"] = _tool(
    generate, wd, "--temperature=0", "--max_new_tokens=8", "--prompt=def "
  )
  assert outputs[wd] == outputs[local]
  assert f"checkpoint step {STEPS} of WORKDIR:" in outputs["generate"][0]
  assert any(l.startswith("def ") for l in outputs["generate"]), outputs["generate"]
  _no_local_gs_dir()


def test_gs_lock_refuses_a_second_run(gs_run, cache):
  """While a run holds the gs:// workdir, train_and_evaluate stops at once, in one line,
  before writing anything."""
  wd = gs_run[0]
  holder = WorkdirLock(wd).acquire()
  before = fileio.walk_files(wd)
  try:
    with pytest.raises(WorkdirInUseError, match=f"is in use by PID {os.getpid()} on host "):
      loop.train_and_evaluate(config(cache, STEPS + 2), wd)
    assert fileio.walk_files(wd) == before
  finally:
    holder.release()
  assert not fileio.exists(fileio.join(wd, ".lock"))


def test_finetune_from_gs_starts_at_the_pretrained_loss(gs_run, reference, cache, tmp_path):
  """init_from=gs://: config, tokenizer and weights read from the bucket; materialised at
  the training K, step 0 evaluates the pre-trained model (the local reference's loss)."""
  c = config(cache, 1)
  c.init_from = gs_run[0]
  c.finetune = ml_collections.ConfigDict(
    dict(
      method="full",
      solver_steps=None,
      lora_rank=2,
      lora_alpha=4.0,
      targets="wq,wo",
      train_embeddings=False,
      lora_init="zero_b",
    )
  )
  loop.train_and_evaluate(c, str(tmp_path))
  eval_loss = dict(metrics_lib.read_scalars(str(tmp_path / "tensorboard"))["eval/loss"])[0]
  np.testing.assert_allclose(eval_loss, reference[2], rtol=1e-5)
  _no_local_gs_dir()


@pytest.mark.parametrize("tool,args", [(spectra, ["--grid=3"]), (lyapunov, ["--text=def f(x):"])])
def test_analysis_reads_and_writes_gs(tool, args, gs_run, gcs_bucket):
  """An analysis tool reads the gs:// run and writes --out=gs://: its files, whose .npz
  holds the arrays the tool returned and whose .json parses."""
  name = tool.__name__.rsplit(".", 1)[-1]
  out = f"{gcs_bucket}/analysis/{name}"
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    res = tool.main([f"--workdir={gs_run[0]}", f"--out={out}", *args])
  files = fileio.walk_files(out)
  assert {f.rsplit(".", 1)[-1] for f in files} == {"npz", "json", "png"} | (
    {"html"} if tool is lyapunov else set()
  ), files
  wrote = printed.getvalue().split("\nwrote ")[1]
  assert sorted(wrote.strip().split(", ")) == [f"{out}/{f}" for f in files], wrote
  arrays = np.load(io.BytesIO(fileio.read_bytes(fileio.join(out, f"{name}.npz"))))
  fields = dataclasses.asdict(res)
  compared = set(arrays.files) & set(fields)  # every field but the trajectory
  assert len(compared) >= 6, compared
  for key in compared:
    np.testing.assert_array_equal(arrays[key], fields[key], err_msg=key)
  for f in files:
    data = fileio.read_bytes(fileio.join(out, f))
    if f.endswith(".json"):
      json.loads(data)
    elif f.endswith(".png"):
      assert data.startswith(b"\x89PNG"), f
  _no_local_gs_dir()
