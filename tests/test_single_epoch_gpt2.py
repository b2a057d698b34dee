"""At toy size: the one-command GPT-2 small single-epoch comparison
(`benchmarks.single_epoch --config=configs/wikipedia_small.py`), run with the config's
`:tiny` variant on a slice of the wikipedia-2015 files, and the GPU script's dry run: the
script's call trains seed 0, the one command here adds seed 1 (seed 0 read back)."""

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import types

from conftest import ROOT, shared_data_path
import pytest

from benchmarks import common
from benchmarks.single_epoch import cli as single_epoch
from configs import owt_small, wikipedia_small
from odetransformer.errors import UserError, describe
from odetransformer.train import loading

NUM = r"([0-9][0-9,]*\.?[0-9]*)"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _num(text):
  return float(text.replace(",", ""))


def _find(pattern, out):
  m = re.search(pattern, out, re.MULTILINE)
  assert m, f"no line matching {pattern!r} in:\n{out}"
  return m


def _wikipedia_slice(tmp_path):
  """The wikipedia-2015 layout, small: two training files, valid and test."""
  wiki = shared_data_path("wikipedia-2015")
  data = tmp_path / "data"
  data.mkdir()
  for name, chars in (
    ("train-00.txt", 30_000),
    ("train-01.txt", 30_000),
    ("valid.txt", 6_000),
    ("test.txt", 6_000),
  ):
    (data / name).write_text((wiki / name).read_text(encoding="utf-8")[:chars], encoding="utf-8")
  return data


def test_wikipedia_small_config_keeps_the_authors_settings():
  """The GPT-2 small run is owt_small (the authors' architecture and optimizer) with only
  the batch, vocabulary, data and remat changed; the benchmark names it gpt2-small."""
  c, authors = wikipedia_small.get_config(), owt_small.get_config()
  model, ref = c.model.to_dict(), authors.model.to_dict()
  assert {k for k in model if model[k] != ref[k]} == {"remat_policy"}
  assert c.optim.to_dict() == authors.optim.to_dict()
  assert (c.model.time_embed_dim, c.model.time_sinusoids, c.model.dropout_rate, c.model.dtype) == (
    20,
    128,
    0.1,
    "bfloat16",
  )
  assert (c.global_batch_size, c.seq_len, c.data.vocab_size) == (64, 1024, 32768)
  assert single_epoch.model_label(c) == "gpt2-small"
  tiny = wikipedia_small.get_config("tiny")
  assert tiny.optim.to_dict() == authors.optim.to_dict()
  assert tiny.model.dropout_rate == 0.1 and single_epoch.model_label(tiny) == "d32-h2-K2"


def _script(env, *args):
  """benchmarks/gpu/wikipedia_small.sh ARGS under `env`, which must succeed."""
  r = subprocess.run(
    ["bash", "benchmarks/gpu/wikipedia_small.sh", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r


@pytest.fixture(scope="module")
def gpu_script(tmp_path_factory):
  """benchmarks/gpu/wikipedia_small.sh with TINY=1 on CPU: `prepare`, then the run on a
  fresh $WORK (as a new machine), which trains seed 0 of the one command. The dry run
  checks it; the one-command comparison continues its workdir with seed 1, so that each
  seed's runs train once, not once per test. (The script keeps the session's compilation
  cache under TINY=1: the seed-1 runs here read seed 0's programs from it.)"""
  shared_data_path("wikipedia-2015")
  tmp = tmp_path_factory.mktemp("gpu_script")
  s = types.SimpleNamespace(pack=tmp / "pack", work=tmp / "work", out=tmp / "out")
  env = dict(os.environ, TINY="1", OUT=str(s.out), WORK=str(s.work), PACK=str(s.pack))
  _script(env, "prepare")
  s.prepared_archive = (s.pack / "wikipedia-2015-tiny.tar.xz").stat().st_size
  s.prepared_tokenizers = list((s.pack / "state" / "cache" / "tokenizers").glob("*.model"))
  shutil.rmtree(s.work)
  _script(env)
  return s


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_script")
def test_one_command_compares_both_models_and_plots_seed0(gpu_script, capsys):
  """Two seeds of both models, 4 steps each (the whole epoch is the default; the same
  code path), curve every 2 steps: the models of a seed share tokenizer, data order and
  tokens; every extra text has its own line; the last line's R ± s is the mean and
  sample deviation of the per-seed ratios of the stored perplexities; the curve PNG
  and item 6's spectra, Lyapunov and clustering PNGs of seed 0's DiffEqFormer exist.
  Seed 0 trained in the GPU script's dry run (the same command with --seeds=1); the
  command here, with --seeds=2, reads it back and trains seed 1."""
  runs = gpu_script.work / "runs"
  # The command the script ran (its own record), with a second seed.
  command = (gpu_script.out / "command.txt").read_text().split()
  assert command[:3] == ["python", "-m", "benchmarks.single_epoch"]
  assert "--config=configs/wikipedia_small.py:tiny" in command and "--seeds=1" in command
  flags = ["--seeds=2" if f == "--seeds=1" else f for f in command[3:]]
  [texts] = [f.split("=", 1)[1].split(",") for f in flags if f.startswith("--eval_text=")]
  assert len(texts) == 2
  # The code version of the sources as they are now, as the script's process read it.
  common.code_version.cache_clear()
  single_epoch.main(flags)
  out = capsys.readouterr().out
  trained_in = {0: (gpu_script.out / "single_epoch.log").read_text(), 1: out}
  lines = out.strip().splitlines()
  evals = {
    (kind, seed): json.loads(
      (runs / f"{kind}_seed{seed}_steps4" / "single_epoch_evals.json").read_text()
    )["4"]
    for kind in ("diffeqformer", "transformer")
    for seed in (0, 1)
  }

  for seed in (0, 1):
    ode, gpt = (runs / f"{kind}_seed{seed}_steps4" for kind in ("diffeqformer", "transformer"))
    # One tokenizer, one data order: the runs' configs differ in the model kind alone,
    # and both streams stopped at the same document.
    assert (ode / "tokenizer.model").read_bytes() == (gpt / "tokenizer.model").read_bytes()
    c_ode, c_gpt = (loading.load_run_config(str(w)).record for w in (ode, gpt))
    m_ode, m_gpt = c_ode.pop("model"), c_gpt.pop("model")
    assert {k for k in m_ode if m_ode[k] != m_gpt[k]} == {"kind"}
    assert (m_ode["kind"], m_gpt["kind"]) == ("diffeqformer", "transformer")
    assert c_ode == c_gpt and c_ode["seed"] == seed
    assert (
      evals["diffeqformer", seed]["documents_read"] == evals["transformer", seed]["documents_read"]
    )
    _find(
      rf"^tokens seen per model: 256 \(4 steps x 2 rows x 32 targets\); documents read "
      rf"{NUM} of {NUM} .*: single epoch, no token position of the training text served "
      r"twice$",
      out,
    )
    for kind in ("diffeqformer", "transformer"):
      e = evals[kind, seed]
      # The curve: the loop's valid evaluations at 2 and 4; at 4 the whole split, as the
      # final score.
      assert sorted(e["curve"]) == ["2", "4"]
      # The same model and split in two programs (the loop's eval step, the scorer's), and
      # the curve's value a float32 TensorBoard scalar: equal up to float32 sums over
      # the split's tokens, not to the last printed digit (500.045 printed as 500.05 and
      # 500.04 once).
      curve_loss, valid_loss = math.log(e["curve"]["4"]), math.log(e["valid"]["perplexity"])
      assert curve_loss == pytest.approx(valid_loss, abs=1e-5)  # 1.4e-7 to 6.6e-7 measured
      m = _find(
        rf"^seed {seed} {kind}\s+\| 4 steps \| valid ppl\s+{NUM} \| test ppl\s+{NUM} "
        rf"\| {NUM} test tokens \| train {NUM} s, score {NUM} s on 1 x \S+ \(cpu\) \| "
        r"trained now$",
        trained_in[seed],
      )
      assert _num(m.group(2)) == pytest.approx(e["test"]["perplexity"], abs=0.005)
    for path in texts:
      o, g = (
        evals[kind, seed]["texts"][path]["perplexity"] for kind in ("diffeqformer", "transformer")
      )
      assert len([l for l in lines if l.startswith(f"seed {seed} eval_text {path} |")]) == 1
      _find(
        rf"^seed {seed} eval_text {re.escape(path)} \| diffeqformer ppl {o:.2f} \| "
        rf"transformer ppl {g:.2f} \| diffeqformer/gpt ratio {o / g:.3f} \| {NUM} tokens$",
        out,
      )
  # Seed 0 (and its analysis) read back, seed 1 trained.
  assert out.count("| trained now") == 2 and out.count("| read back from ") == 2
  assert re.search(r"^analysis of diffeqformer_seed0_steps4: read back from ", out, re.M)

  def ratios(where):
    return [where(evals["diffeqformer", s]) / where(evals["transformer", s]) for s in (0, 1)]

  for path in texts:
    r = ratios(lambda e, path=path: e["texts"][path]["perplexity"])
    assert (
      f"eval_text {path}: diffeqformer/gpt perplexity ratio {statistics.mean(r):.3f} ± "
      f"{statistics.stdev(r):.3f} (2 seeds)"
    ) in lines
  m = _find(r"^wall time of this command: ([0-9.]+) s on 1 x \S+ \(cpu\)$", out)
  assert float(m.group(1)) > 0
  n_ode, n_gpt = (evals[kind, 0]["num_params"] for kind in ("diffeqformer", "transformer"))
  assert (
    f"parameters: diffeqformer {n_ode:,} | gpt {n_gpt:,}: the DiffEqFormer holds "
    f"{n_ode / n_gpt:.1f}x GPT's parameters (its hypernetworks)" in lines
  )
  r = ratios(lambda e: e["test"]["perplexity"])
  m = re.fullmatch(
    r"(\S+) single-epoch diffeqformer/gpt test perplexity ratio: ([0-9.]+) ± "
    r"([0-9.]+) \(2 seeds, 256 tokens\)",
    lines[-1],
  )
  assert m, lines[-1]
  assert m.group(1) == "d32-h2-K2"
  assert (m.group(2), m.group(3)) == (f"{statistics.mean(r):.3f}", f"{statistics.stdev(r):.3f}")

  # The same command again (e.g. the GPU's next call): every score and the analysis are
  # read back, nothing trains, and the report ends the same.
  single_epoch.main(flags)
  again = capsys.readouterr().out
  assert again.strip().splitlines()[-1] == lines[-1]
  assert "trained now" not in again and again.count("| read back from ") == 4
  assert re.search(r"^analysis of diffeqformer_seed0_steps4: read back from ", again, re.M)

  pngs = [runs / "single_epoch.png"] + [
    runs / "analysis" / f"{name}.png"
    for name in (
      "spectra_qk",
      "spectra_ov",
      "spectra_ff",
      "lyapunov",
      "clustering",
      "clustering_dispersion",
      "clustering_trained",
    )
  ]
  for png in pngs:
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000, png
  trained = json.loads((runs / "analysis" / "clustering_trained.json").read_text())
  assert trained["times"] == [0.0, 0.5, 1.0] and trained["tokens"] == 8  # K = 2 steps
  assert all(0 <= d <= 2 for d in trained["mean_pairwise_distance"])
  spectra = json.loads((runs / "analysis" / "spectra_summary.json").read_text())
  assert spectra["kind"] == "diffeqformer" and len(spectra["times"]) == 4
  assert json.loads((runs / "analysis" / "lyapunov.json").read_text())["position"] == 7


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      ["--eval_text=/nonexistent/x.txt"],
      "error: --eval_text: /nonexistent/x.txt is not a file; pass existing text files, "
      "comma-separated",
    ),
    (
      ["--config=configs/wikipedia_small.py", "--lr=1e-3"],
      "error: --lr applies without --config; with --config=configs/wikipedia_small.py the "
      "config sets the model and optimizer (edit it, or leave --config out)",
    ),
    (
      ["--config=configs/wikipedia_small.py:huge"],
      "error: --config=configs/wikipedia_small.py:huge: variant 'huge': the variants are '' "
      "and 'tiny'; pass FILE.py[:VARIANT] whose get_config() returns a ConfigDict, e.g. "
      "configs/wikipedia_small.py",
    ),
    (
      ["--steps=x"],
      "error: flag --steps=x: invalid literal for int() with base 10: 'x'; see --helpshort "
      "for the flags",
    ),
  ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, flags, message):
  """A bad flag is a UserError, which `errors.run_cli` prints as one line (exit 2)."""
  with pytest.raises(UserError) as e:
    single_epoch.parse_args([f"--data_dir={_wikipedia_slice(tmp_path)}", *flags])
  assert f"error: {describe(e.value)}".endswith(message)


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_script")
def test_gpu_script_dry_run(gpu_script):
  """benchmarks/gpu/wikipedia_small.sh with TINY=1 on CPU: `prepare` packs the data as xz,
  unpacks it, trains the tokenizer and keeps it in the state; the run (on a fresh $WORK,
  as a new machine) unpacks again, restores the state, trains no tokenizer, runs the one
  command and leaves the log, table, PNGs and the next call's state in $OUT."""
  out = gpu_script.out
  assert gpu_script.prepared_archive > 0
  assert gpu_script.prepared_tokenizers
  assert "training a 512-piece SentencePiece" not in (out / "train.log").read_text()
  assert (out / "state" / "diffeqformer_seed0_steps4" / "single_epoch_evals.json").is_file()
  log = (out / "single_epoch.log").read_text()
  assert re.search(
    r"^d32-h2-K2 single-epoch diffeqformer/gpt test perplexity ratio: "
    r"[0-9.]+ \(1 seed, [0-9,]+ tokens\)$",
    log.strip().splitlines()[-1],
  )
  for name in (
    "single_epoch.png",
    "single_epoch.md",
    "analysis/spectra_qk.png",
    "analysis/lyapunov.png",
    "analysis/clustering_trained.png",
  ):
    assert (out / name).stat().st_size > 0, name
