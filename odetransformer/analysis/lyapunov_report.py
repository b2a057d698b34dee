"""Token sensitivity's outputs: the Lyapunov and attention maps compared, drawn and written.

The maps' rank correlation, the text coloured by each map side by side (an HTML page
and a PNG), lyapunov.{json,npz,html,png} in an output directory (local or gs://), and
the one-line summary the command prints. The maps come from
`lyapunov_exponents.sensitivity`.
"""

from collections.abc import Sequence
import html
import json

import numpy as np

from odetransformer.analysis.lyapunov_exponents import Sensitivity
from odetransformer.runtime import fileio


def spearman(a, b) -> float:
  """Spearman rank correlation of two maps (ties get their average rank); nan when
  either map is constant."""
  from scipy.stats import rankdata  # lazy: scipy.stats takes seconds to import

  if len(a) < 2:
    return float("nan")
  ra, rb = rankdata(np.asarray(a)), rankdata(np.asarray(b))
  ra, rb = ra - ra.mean(), rb - rb.mean()
  den = np.sqrt((ra * ra).sum() * (rb * rb).sum())
  return float((ra * rb).sum() / den) if den > 0 else float("nan")


def context_indices(position: int) -> np.ndarray:
  """The tokens the maps are compared on: those before the output position (all of
  0…o when o < 2, so there is something to rank)."""
  return np.arange(position if position >= 2 else position + 1)


def map_correlation(res) -> float:
  """Spearman ρ between the Lyapunov and attention maps over `context_indices`."""
  idx = context_indices(res.position)
  return spearman(res.scores[idx], res.attention[idx])


def colour_scale(values, position: int):
  """Values mapped to [0, 1] for colouring: min–max over the tokens before `position`
  (the output token itself, whose self-Jacobian usually dominates, is clipped to 1),
  or over the one token when `position` is 0. Tokens after it are not coloured."""
  v = np.asarray(values, np.float64)
  ref = v[:position] if position > 0 else v[:1]
  lo, hi = ref.min(), ref.max()
  return np.clip((v - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.full_like(v, 0.5)


def _css_color(cmap, u):
  r, g, b, _ = cmap(float(u))
  return f"rgb({int(255 * r)},{int(255 * g)},{int(255 * b)})"


def render_html(pieces, res: Sensitivity, title: str = "") -> str:
  """Two coloured copies of the text: Lyapunov score and attention, side by side."""
  import matplotlib  # lazy: matplotlib only for the pictures

  matplotlib.use("Agg")
  from matplotlib import colormaps  # lazy: after the Agg backend is chosen

  cmap = colormaps["Reds"]
  active = np.arange(len(pieces)) <= res.position

  def text_block(values, fmt):
    u = colour_scale(values, res.position)
    spans = []
    for i, piece in enumerate(pieces):
      tip = f"#{i}: {fmt(values[i])}" if active[i] else f"#{i}: after o"
      style = f"background:{_css_color(cmap, 0.85 * u[i])}" if active[i] else "color:#999"
      if i == res.position:
        style += ";outline:2px solid #1f77b4"
      spans.append(f"<span title='{html.escape(tip)}' style='{style}'>{html.escape(piece)}</span>")
    return "".join(spans)

  lyap = text_block(res.scores, lambda v: f"λ_max = {v:.4g}")
  att = text_block(res.attention, lambda v: f"attention = {v:.4g}")
  rho = map_correlation(res)
  return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Lyapunov sensitivity</title>
<style>body{{font-family:sans-serif;margin:1.5em}} .row{{display:flex;gap:2em}}
.col{{flex:1}} .text{{font-family:monospace;white-space:pre-wrap;line-height:1.9;
border:1px solid #ddd;padding:.6em}}</style></head><body>
<h3>Token sensitivity of output position {res.position} ({html.escape(pieces[res.position])!s})</h3>
<p>{html.escape(title)} K={res.num_steps} steps, dt={res.dt:.4g}. Colour (white → red): min–max over
the tokens before position {res.position} (the output token itself, outlined, is clipped to the top
colour); grey tokens come after it. Hover for values.
Spearman rank correlation of the two maps: {rho:.3f}.</p>
<div class="row">
<div class="col"><h4>Lyapunov score (max finite-time exponent)</h4><div class="text">{lyap}</div></div>
<div class="col"><h4>Attention (mean over heads and steps)</h4><div class="text">{att}</div></div>
</div></body></html>
"""  # noqa: E501  the HTML page's own lines


def _flow_text(ax, fig, pieces, values, active, position, cmap, title):
  """Draws the pieces left to right with coloured boxes, wrapping at the axes' width."""
  ax.set_axis_off()
  ax.set_title(title, fontsize=10, loc="left")
  renderer = fig.canvas.get_renderer()
  u = colour_scale(values, position)
  x, y, line_h = 0.0, 0.95, 0.0
  ax_w = ax.get_window_extent(renderer).width
  ax_h = ax.get_window_extent(renderer).height
  for i, piece in enumerate(pieces):
    shown = piece if piece.strip() else piece.replace(" ", "\u2423") or "\u2423"
    face = cmap(0.85 * u[i]) if active[i] else (0.93, 0.93, 0.93)
    txt = ax.text(
      x,
      y,
      shown,
      fontsize=9,
      family="monospace",
      va="top",
      ha="left",
      color="black" if active[i] else "0.55",
      transform=ax.transAxes,
      bbox=dict(
        boxstyle="square,pad=0.15", fc=face, ec="#1f77b4" if i == position else "none", lw=1.5
      ),
    )
    bb = txt.get_window_extent(renderer)
    w, h = bb.width / ax_w, bb.height / ax_h
    if x > 0 and x + w > 1.0:
      x, y = 0.0, y - 1.6 * max(line_h, h)
      txt.set_position((x, y))
      line_h = 0.0
    x += w + 0.004
    line_h = max(line_h, h)


def render_png(pieces, res: Sensitivity, path: str, title: str = "") -> None:
  """The text coloured by the Lyapunov score (left) and by attention (right)."""
  import matplotlib  # lazy: matplotlib only for the pictures

  matplotlib.use("Agg")
  from matplotlib import colormaps  # lazy: after the Agg backend is chosen
  import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

  cmap = colormaps["Reds"]
  n_chars = sum(len(p) + 1 for p in pieces)
  height = 0.8 + 0.3 * (1 + n_chars // 100)  # ~100+ characters per panel line
  fig, axes = plt.subplots(1, 2, figsize=(14, height))
  fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=1.0 - 0.55 / height, wspace=0.04)
  active = np.arange(len(pieces)) <= res.position
  _flow_text(
    axes[0],
    fig,
    pieces,
    res.scores,
    active,
    res.position,
    cmap,
    "Lyapunov score (max finite-time exponent)",
  )
  _flow_text(
    axes[1],
    fig,
    pieces,
    res.attention,
    active,
    res.position,
    cmap,
    "attention (mean over heads and steps)",
  )
  rho = map_correlation(res)
  fig.suptitle(
    f"{title}: output position {res.position} ({pieces[res.position]!r}, outlined); "
    f"colour min–max over the tokens before it; Spearman ρ = {rho:.2f}",
    fontsize=10,
    y=1.0 - 0.08 / height,
    va="top",
  )
  fileio.write_figure(path, fig, dpi=120)
  plt.close(fig)


def write_outputs(res: Sensitivity, pieces: Sequence[str], out_dir: str, title: str = "") -> dict:
  """lyapunov.{json,npz,html,png} in `out_dir` (a local directory or a URL such as
  gs://...); returns name -> path."""
  paths = {
    name: fileio.join(out_dir, f"lyapunov.{name}") for name in ("json", "npz", "html", "png")
  }
  fileio.write_text_atomic(
    paths["json"],
    json.dumps(
      {
        "position": res.position,
        "num_steps": res.num_steps,
        "dt": res.dt,
        "axis": res.axis_label,
        "spearman_lyapunov_attention": map_correlation(res),
        "tokens": [
          {
            "index": i,
            "id": int(t),
            "piece": pieces[i],
            "lyapunov": float(res.scores[i]),
            "attention": float(res.attention[i]),
          }
          for i, t in enumerate(res.tokens)
        ],
      },
      indent=1,
      ensure_ascii=False,
    ),
  )
  fileio.write_npz(
    paths["npz"],
    tokens=res.tokens,
    position=res.position,
    exponents=res.exponents,
    scores=res.scores,
    attention=res.attention,
    attention_steps=res.attention_steps,
    times=res.times,
    dt=res.dt,
  )
  fileio.write_text_atomic(paths["html"], render_html(list(pieces), res, title))
  render_png(list(pieces), res, paths["png"], title)
  return paths


def summary_line(res: Sensitivity, pieces: Sequence[str], top: int = 5) -> str:
  idx = context_indices(res.position)

  def tops(values):
    order = idx[np.argsort(-values[idx], kind="stable")][:top]
    return ", ".join(f"{pieces[i]!r}@{i} {values[i]:.3g}" for i in order)

  rho = map_correlation(res)
  return (
    f"lyapunov: output position {res.position} ({pieces[res.position]!r}, "
    f"λ_max {res.scores[res.position]:.3g}) over {res.position + 1} tokens, "
    f"K={res.num_steps} dt={res.dt:.4g}; earlier tokens, top Lyapunov: "
    f"{tops(res.scores)} | top attention: {tops(res.attention)} | Spearman ρ={rho:.3f}"
  )
