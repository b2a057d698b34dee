"""The analysis stage of `benchmarks.single_epoch`: Section 5's
views of the first seed's trained DiffEqFormer (spectra, Lyapunov map, clustering), drawn
into D/analysis by the `odetransformer.analysis` package, and App. C.8's clustering
measure along the model's own trajectory."""

import os

import jax
import numpy as np

from benchmarks import common
from benchmarks.single_epoch.runs import run_name
from odetransformer.analysis import clustering, fields, lyapunov, spectra
from odetransformer.errors import UserError
from odetransformer.train import loading


def trained_dispersion(model, res) -> dict:
  """App. C.8's clustering measure on the trained model's own trajectory: the tokens'
  states x(t) (Lyapunov's trajectory and its last Euler step), each centred over its
  features as the block's norm does and projected to the unit sphere, then the mean
  pairwise distance, the number of clusters and the polarisation gap of
  `analysis.clustering` at every t."""
  steps = fields.euler_steps(model)
  field = jax.jit(fields.vector_field(model.config, res.trajectory.shape[1], steps.dt))
  last = {name: w[-1] for name, w in steps.weights.items()}
  x_end = res.trajectory[-1] + steps.dt * np.asarray(field(res.trajectory[-1], last))
  states = [np.asarray(x, np.float64) for x in list(res.trajectory) + [x_end]]
  unit = [np.asarray(clustering.normalise(x - x.mean(-1, keepdims=True))) for x in states]
  return {
    "times": (np.arange(len(states)) * steps.dt).tolist(),
    "axis": steps.axis_label,
    "mean_pairwise_distance": [clustering.mean_pairwise_distance(u) for u in unit],
    "clusters": [clustering.num_clusters(u) for u in unit],
    "polarisation_gap": [clustering.polarisation_gap(u) for u in unit],
    "tokens": int(res.trajectory.shape[1]),
  }


def analyse(workdir: str, out: str, args) -> dict:
  """Section 5's views of one trained DiffEqFormer (the paper's Fig. 2, 3), written to `out`
  by the analysis package (spectra_{qk,ov,ff}.png, lyapunov.png/.html, App. C.8's
  simulation clustering.png and clustering_dispersion.png) and the clustering measure
  along the model's own trajectory (clustering_trained.png/.json); returns name -> path."""
  names = (
    "spectra_qk",
    "spectra_ov",
    "spectra_ff",
    "lyapunov",
    "clustering",
    "clustering_dispersion",
    "clustering_trained",
  )
  done = {name: os.path.join(out, f"{name}.png") for name in names}
  stamp = os.path.join(out, "analysed.json")
  if common.read_json(stamp) == {
    "run": os.path.basename(workdir),
    "code": common.code_version(),
  } and all(os.path.isfile(p) for p in done.values()):
    print(
      f"analysis of {os.path.basename(workdir)}: read back from {out} (code "
      f"{common.code_version()})",
      flush=True,
    )  # e.g. a later call without its checkpoint
    return done
  os.makedirs(out, exist_ok=True)
  loaded = loading.load_model(workdir)
  model = loaded.model
  found = spectra.compute_spectra(model, args.spectra_grid)
  paths = {f"spectra_{k}": v for k, v in spectra.write_outputs(found, out).items()}
  print(spectra.summary_line(found), flush=True)
  tokenizer = loading.load_tokenizer(workdir)
  with open(os.path.join(args.data_dir, "test.txt"), encoding="utf-8") as f:
    head = f.read(50_000)  # the first held-out article(s)
  count = min(args.lyapunov_tokens, loaded.model_config.max_len)
  ids = [tokenizer.eos_id()] + list(tokenizer.encode(head))[: count - 1]  # eos: as in training
  res = lyapunov.sensitivity(model, ids, -1)
  pieces = [lyapunov.piece_text(tokenizer, i) for i in ids]
  title = f"{loaded.model_config.kind} ({os.path.basename(workdir)}, step {loaded.step})"
  paths.update(
    {f"lyapunov_{k}": v for k, v in lyapunov.write_outputs(res, pieces, out, title).items()}
  )
  print(lyapunov.summary_line(res, pieces), flush=True)
  clustering.main([f"--out={out}"])  # App. C.8's simulation, as the paper ran it
  paths["clustering_png"] = os.path.join(out, "clustering.png")
  paths["clustering_dispersion_png"] = os.path.join(out, "clustering_dispersion.png")
  measure = trained_dispersion(model, res)
  measure["text"] = "".join(pieces)
  common.write_json(os.path.join(out, "clustering_trained.json"), measure)
  from matplotlib.figure import Figure  # lazy: matplotlib only for the plots

  fig = Figure(figsize=(6, 3.8), layout="constrained")
  ax = fig.add_subplot()
  ax.plot(measure["times"], measure["mean_pairwise_distance"], "o-", label="mean pairwise distance")
  ax.plot(measure["times"], measure["polarisation_gap"], "s--", label="1 - |mean x|")
  for t, d, n in zip(measure["times"], measure["mean_pairwise_distance"], measure["clusters"]):
    ax.annotate(str(n), (t, d), textcoords="offset points", xytext=(0, 5), fontsize=7)
  ax.set_xlabel(measure["axis"])
  ax.set_ylabel("on the unit sphere")
  ax.set_title(
    f"{title}\n{measure['tokens']} tokens' states along t (numbers: clusters)", fontsize=9
  )
  ax.legend(fontsize=8)
  paths["clustering_trained_png"] = os.path.join(out, "clustering_trained.png")
  paths["clustering_trained_json"] = os.path.join(out, "clustering_trained.json")
  fig.savefig(paths["clustering_trained_png"], dpi=110)
  d = measure["mean_pairwise_distance"]
  common.write_json(stamp, {"run": os.path.basename(workdir), "code": common.code_version()})
  print(
    f"clustering along {os.path.basename(workdir)}'s trajectory ({measure['tokens']} "
    f"tokens): mean pairwise distance t=0 {d[0]:.3f} -> t=1 {d[-1]:.3f}, "
    f"{measure['clusters'][-1]} cluster(s) at the end",
    flush=True,
  )
  return paths


def analyse_or_say_why_not(args, root: str, seed: int, steps: int) -> None:
  """`analyse` of the seed's DiffEqFormer; when its checkpoint is gone (its scores were
  read back in a later call on another machine) a line says so and the report goes on."""
  try:
    analyse(
      os.path.join(root, run_name(args, "diffeqformer", seed, steps)),
      os.path.join(root, "analysis"),
      args,
    )
  except UserError as e:
    print(f"analysis skipped: {e}", flush=True)
