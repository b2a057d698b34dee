"""Spectral flow of the attention and feed-forward weights (paper §5.1, Fig. 2a/b, App. E).

Per head h, the eigenvalues of

    W_QK,h = W_Q,h W_K,hᵀ   (d×d, rank ≤ head_dim)   — who talks to whom,
    W_OV,h = W_V,h W_O,h    (d×d, rank ≤ head_dim)   — what is passed on,

and of the feed-forward product W_FF = W_1 W_2 (d×d), along t on any grid (an ODE's
weights are continuous in t) or per layer for a discrete model. A d×d product of rank
head_dim has d − head_dim zero eigenvalues; the other head_dim are those of the small
matrix with the factors swapped (AB and BA share their non-zero spectrum), so QK and OV
report the head_dim eigenvalues of W_K,hᵀ W_Q,h and W_O,h W_V,h. The raw weights are
used: no 1/√head_dim score scale, no norm scales, no dt (materialised models have dt
folded into W_O and W_2). For the Llama family W_FF ignores the gate W_3.

    python -m odetransformer.analysis.spectra --workdir=W --out=DIR [--grid=64]

writes DIR/spectra.npz, DIR/spectra_{qk,ov,ff}.png and prints one summary line. The
model loads on the run's mesh (or --mesh_shape=1,-1,1 ...), under `jax.distributed` when
launched as several processes; process 0 writes.
"""

import dataclasses
import json

import jax
import numpy as np

from odetransformer import cli_flags, errors
from odetransformer.analysis import fields
from odetransformer.runtime import fileio, host
from odetransformer.train import loading


@dataclasses.dataclass
class Spectra:
  """Eigenvalues along t (or per layer), each set sorted by descending real part."""

  times: np.ndarray  # [T] times t, or layer indices
  axis_label: str  # 't' or 'layer'
  qk: np.ndarray  # complex [T, heads, head_dim]
  ov: np.ndarray  # complex [T, heads, head_dim]
  ff: np.ndarray  # complex [T, d]
  kind: str = ""


def _sorted_desc(eigs):
  """Sorts the last axis by descending real part (then imaginary part)."""
  return np.sort(eigs, axis=-1)[..., ::-1]


def eigenvalues(weights: dict) -> dict:
  """{'qk', 'ov', 'ff'} eigenvalues of stacked layer params (numpy, float64).

  Args:
    weights: name -> [T, *shape] with 'wq' [T, d, n, h], 'wk', 'wv' [T, d, n_kv, h]
      (n_kv dividing n; the key/value heads of grouped-query attention), 'wo' [T, n, h, d],
      'w1' [T, d, f], 'w2' [T, f, d].
  Returns:
    'qk' [T, n, h], 'ov' [T, n, h], 'ff' [T, d]: complex, sorted by descending real part.
  """
  w = {k: loading.to_host(weights[k], np.float64) for k in ("wq", "wk", "wv", "wo", "w1", "w2")}
  group = w["wq"].shape[2] // w["wk"].shape[2]  # grouped-query attention: head i reads i // group
  w["wk"], w["wv"] = (np.repeat(w[k], group, axis=2) for k in ("wk", "wv"))
  kq = np.einsum("tdna,tdnb->tnab", w["wk"], w["wq"])  # W_K,hᵀ W_Q,h   [h, h]
  ov = np.einsum("tnad,tdnb->tnab", w["wo"], w["wv"])  # W_O,h W_V,h    [h, h]
  ff = np.einsum("tdf,tfe->tde", w["w1"], w["w2"])  # W_1 W_2        [d, d]
  return {
    "qk": _sorted_desc(np.linalg.eigvals(kq)),
    "ov": _sorted_desc(np.linalg.eigvals(ov)),
    "ff": _sorted_desc(np.linalg.eigvals(ff)),
  }


_NEEDED = ("wq", "wk", "wv", "wo", "w1", "w2")


def compute_spectra(model, grid: int = 64, chunk: int = 16) -> Spectra:
  """Spectra of a model: on `grid` points t ∈ [0, 1] (ODE kinds) or per layer.

  An ODE's weights are generated `chunk` times at a time, so memory stays that of
  `chunk` layers whatever the grid.
  """
  cfg = model.config
  if cfg.is_ode:
    if grid < 2:
      raise ValueError(f"grid={grid} must be at least 2 points")
    times = np.linspace(0.0, 1.0, grid, dtype=np.float32)
    parts = []
    for ts in np.array_split(times, -(-grid // max(1, chunk))):
      weights = fields.weights_at(model, ts)
      parts.append(eigenvalues({k: weights[k] for k in _NEEDED}))
    eigs = {k: np.concatenate([p[k] for p in parts]) for k in ("qk", "ov", "ff")}
    label = "t"
  else:
    weights = fields.layer_weights(model)
    eigs, label = eigenvalues({k: weights[k] for k in _NEEDED}), "layer"
    times = np.arange(cfg.depth, dtype=np.float32)
  return Spectra(times=times, axis_label=label, kind=cfg.kind, **eigs)


def spread(eigs) -> np.ndarray:
  """Range of the real parts, max Re λ − min Re λ, per set: [T, (heads)]."""
  re = np.real(eigs)
  return re.max(-1) - re.min(-1)


def spread_along(spectra: Spectra) -> dict:
  """Per matrix, the spread along the axis: QK and OV averaged over heads. name -> [T]."""
  return {
    "qk": spread(spectra.qk).mean(-1),
    "ov": spread(spectra.ov).mean(-1),
    "ff": spread(spectra.ff),
  }


def summary_line(spectra: Spectra) -> str:
  """One line: how the eigenvalue spread changes from the first to the last t (or layer)."""
  t = spectra.times
  parts = []
  for name, s in spread_along(spectra).items():
    ratio = s[-1] / s[0] if s[0] > 0 else float("inf")
    parts.append(
      f"{name.upper()} {s[0]:.3g}→{s[-1]:.3g} (×{ratio:.2f}, "
      f"peak {s.max():.3g} at {spectra.axis_label}={t[int(np.argmax(s))]:.3g})"
    )
  where = (
    f"t ∈ [{t[0]:.3g}, {t[-1]:.3g}], {len(t)} points"
    if spectra.axis_label == "t"
    else f"{len(t)} layers"
  )
  return (
    f"spectra ({spectra.kind}, {where}): eigenvalue spread max−min Re λ "
    f"(QK/OV mean over heads), first→last: " + "; ".join(parts)
  )


def save_npz(spectra: Spectra, path: str) -> None:
  spreads = spread_along(spectra)
  fileio.write_npz(
    path,
    times=spectra.times,
    axis_label=spectra.axis_label,
    kind=spectra.kind,
    qk=spectra.qk,
    ov=spectra.ov,
    ff=spectra.ff,
    qk_spread=spreads["qk"],
    ov_spread=spreads["ov"],
    ff_spread=spreads["ff"],
  )


# ------------------------------------------------------------------------------ plots
def _lines(ax, x, values, cmap, marker):
  """One line per eigenvalue rank (values [T, r], already ordered per t)."""
  from matplotlib.ticker import MaxNLocator  # lazy: matplotlib only for the plots

  r = values.shape[-1]
  colors = cmap(np.linspace(0.0, 1.0, max(r, 2)))
  for j in range(r):
    ax.plot(x, values[:, j], color=colors[j], lw=1.0, marker=marker, ms=3)
  if marker:  # per layer: integer ticks
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_heads(eigs, times, axis_label: str, title: str, path: str, max_cols: int = 8):
  """Real part (sorted) and magnitude (sorted) vs t, one column per head."""
  import matplotlib  # lazy: matplotlib only for the plots

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

  n = eigs.shape[1]
  cols = min(n, max_cols)
  blocks = -(-n // cols)
  fig, axes = plt.subplots(
    2 * blocks, cols, figsize=(2.6 * cols + 0.6, 4.4 * blocks), squeeze=False, sharex=True
  )
  marker = "o" if axis_label == "layer" else None
  re = np.sort(np.real(eigs), axis=-1)[..., ::-1]
  mag = np.sort(np.abs(eigs), axis=-1)[..., ::-1]
  re_lim = (re.min(), re.max())
  mag_lim = (0.0, mag.max())
  pad = lambda lo, hi: (lo - 0.05 * (hi - lo + 1e-12), hi + 0.05 * (hi - lo + 1e-12))
  for h in range(blocks * cols):
    b, c = divmod(h, cols)
    ax_re, ax_mag = axes[2 * b, c], axes[2 * b + 1, c]
    if h >= n:
      ax_re.axis("off")
      ax_mag.axis("off")
      continue
    _lines(ax_re, times, re[:, h], plt.cm.coolwarm_r, marker)
    _lines(ax_mag, times, mag[:, h], plt.cm.viridis, marker)
    ax_re.axhline(0.0, color="k", lw=0.5)
    ax_re.set_ylim(*pad(*re_lim))
    ax_mag.set_ylim(*pad(*mag_lim))
    ax_re.set_title(f"head {h}", fontsize=9)
    if c == 0:
      ax_re.set_ylabel("Re λ")
      ax_mag.set_ylabel("|λ|")
    ax_mag.set_xlabel(axis_label)
    for ax in (ax_re, ax_mag):
      ax.tick_params(labelsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fileio.write_figure(path, fig, dpi=110)
  plt.close(fig)


def plot_ff(eigs, times, axis_label: str, title: str, path: str):
  import matplotlib  # lazy: matplotlib only for the plots

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

  fig, (ax_re, ax_mag) = plt.subplots(1, 2, figsize=(9, 3.6))
  marker = "o" if axis_label == "layer" else None
  _lines(ax_re, times, np.sort(np.real(eigs), -1)[:, ::-1], plt.cm.coolwarm_r, marker)
  _lines(ax_mag, times, np.sort(np.abs(eigs), -1)[:, ::-1], plt.cm.viridis, marker)
  ax_re.axhline(0.0, color="k", lw=0.5)
  ax_re.set_ylabel("Re λ")
  ax_mag.set_ylabel("|λ|")
  for ax in (ax_re, ax_mag):
    ax.set_xlabel(axis_label)
  fig.suptitle(title)
  fig.tight_layout()
  fileio.write_figure(path, fig, dpi=110)
  plt.close(fig)


def write_outputs(spectra: Spectra, out_dir: str) -> dict:
  """spectra.npz, spectra_summary.json and the three PNGs in `out_dir` (a local
  directory or a URL such as gs://...); returns name -> path."""
  paths = {
    "npz": fileio.join(out_dir, "spectra.npz"),
    "summary": fileio.join(out_dir, "spectra_summary.json"),
    "qk": fileio.join(out_dir, "spectra_qk.png"),
    "ov": fileio.join(out_dir, "spectra_ov.png"),
    "ff": fileio.join(out_dir, "spectra_ff.png"),
  }
  save_npz(spectra, paths["npz"])
  spreads = spread_along(spectra)
  fileio.write_text_atomic(
    paths["summary"],
    json.dumps(
      {
        "kind": spectra.kind,
        "axis": spectra.axis_label,
        "times": spectra.times.tolist(),
        "spread": {k: v.tolist() for k, v in spreads.items()},
        "summary": summary_line(spectra),
      },
      indent=1,
    ),
  )
  where = f"({spectra.kind})"
  plot_heads(
    spectra.qk,
    spectra.times,
    spectra.axis_label,
    f"eigenvalues of W_Q,h W_K,hᵀ per head {where}",
    paths["qk"],
  )
  plot_heads(
    spectra.ov,
    spectra.times,
    spectra.axis_label,
    f"eigenvalues of W_V,h W_O,h per head {where}",
    paths["ov"],
  )
  plot_ff(
    spectra.ff, spectra.times, spectra.axis_label, f"eigenvalues of W_1 W_2 {where}", paths["ff"]
  )
  return paths


# -------------------------------------------------------------------------------- CLI
def define_flags(define) -> None:
  """This command's flags (`cli_flags.parse_flags`); the loading ones from
  `loading.define_load_flags`."""
  define(
    "string",
    "out",
    None,
    "Output directory (local or gs://...) for .npz, .json and PNGs.",
    required=True,
  )
  define("integer", "grid", 64, "Points t in [0, 1] for ODE models (discrete models: every layer).")
  loading.define_load_flags(define)


def parse_args(argv):
  """The flags of `argv` (without the program name; None: sys.argv[1:])."""
  return cli_flags.parse_flags(
    define_flags,
    argv,
    doc="Eigenvalues of W_QK, W_OV per head and of W_1 W_2, along t or per layer.",
  )


def main(argv: list | None = None) -> Spectra:
  """The command line; a bad flag or workdir is a UserError (one line: errors.run_cli)."""
  args = parse_args(argv)  # None: sys.argv[1:]
  if args.grid < 2:
    raise errors.UserError(
      f"--grid={args.grid}: an ODE's spectra need at least 2 points "
      "t in [0, 1]; pass --grid=2 or more (default 64)"
    )
  loading.parse_mesh_shape(args.mesh_shape)
  loading.load_run_config(args.workdir)
  host.initialize_distributed()  # several processes: jax.distributed, as main.py
  loaded = loading.load_model(
    args.workdir,
    step=args.step,
    mesh_shape=args.mesh_shape,
    allow_unverified=args.checkpoint_allow_unverified,
  )
  spectra = compute_spectra(loaded.model, args.grid)
  if jax.process_index() == 0:  # every process computed them; one writes
    paths = write_outputs(spectra, args.out)
    print(summary_line(spectra))
    print(f"wrote {', '.join(paths.values())}")
  return spectra


if __name__ == "__main__":
  errors.run_cli(main)
