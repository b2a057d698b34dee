"""Token-level sensitivity by finite-time Lyapunov exponents (paper §5.2, Fig. 3, App. B, F).

How much does output position o depend on input token i? Along the model's own Euler
trajectory x_0 … x_{K-1} (x_{k+1} = x_k + dt·F(x_k, t_k)), evolve one tangent matrix
Q_i (d×d, Q_i = I at the start) per input token with the Jacobian block
J_{o,i}(t_k) = ∂F_o/∂x_i (x_k, t_k) of the vector field:

    Q_i ← Q_i + dt·J_{o,i}(t_k)·Q_i,   Q_i, R_i = qr(Q_i),   S_i += log|diag R_i|,

and report the exponents λ_i = S_i / (K·dt) (the total time: 1 for an ODE) and the
score max(λ_i). The Jacobian row block ∂F_o/∂x of all tokens at once is one `jax.vjp`
of F with d cotangents (what `jax.jacrev` does), sharing the forward pass that also
advances x; the per-token tangent update and QR are `vmap`ped over tokens. Tokens after
o do not reach it (causal attention): J_{o,i} = 0, λ_i = 0.

Discrete models ('transformer', 'parallel'): dt = 1 and F is the per-layer residual update, so
the total time and the divisor is the number of layers. Models trained with midpoint or
RK4 are analysed along the Euler solve at the same K (a warning says so).

For comparison the attention map: the attention of o to each token, averaged over heads
and steps (the usual attention-based explanation).

    python -m odetransformer.analysis.lyapunov --workdir=W --text="..." [--position=-1] --out=DIR

writes DIR/lyapunov.json (scores), DIR/lyapunov.npz (full spectra), DIR/lyapunov.html
and DIR/lyapunov.png (the text coloured by each map, side by side). The model loads on
the run's mesh (or --mesh_shape=1,-1,1 ...), under `jax.distributed` when launched as
several processes; process 0 writes.
"""

from collections.abc import Callable, Sequence
import dataclasses
import html
import json
import re
import sys

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer import errors
from odetransformer.analysis import fields
from odetransformer.model import blocks
from odetransformer.runtime import fileio, host
from odetransformer.train import loading
from odetransformer.train.checkpoint.fingerprint import load_config
from odetransformer.train.checkpoint.integrity import UNVERIFIED_FLAG_HELP


# --------------------------------------------------------------------------- numerics
def jacobian_row(field: Callable, x_ld, p, position: int, chunk: int | None = None):
  """(J [l, d, d] with J[i] = ∂F_o/∂x_i, F(x) [l, d]) at one state.

  `chunk` bounds memory: the d cotangents are pulled back `chunk` at a time
  (`jax.lax.map`) instead of all at once (`vmap`, i.e. `jax.jacrev`).
  """
  length, d = x_ld.shape
  f, pullback = jax.vjp(lambda x: field(x, p), x_ld)
  cotangents = (
    jax.nn.one_hot(position, length, dtype=f.dtype)[None, :, None]
    * jnp.eye(d, dtype=f.dtype)[:, None, :]
  )  # [d_out, l, d]
  pull = lambda ct: pullback(ct)[0]
  if chunk is None or chunk >= d:
    rows = jax.vmap(pull)(cotangents)
  else:
    rows = jax.lax.map(pull, cotangents, batch_size=chunk)
  return jnp.transpose(rows, (1, 0, 2)), f  # [l, d_out, d_in]


def _tangent_step(j_dd, q_dd, dt):
  """One token's Q ← qr(Q + dt·J·Q): (new Q, log|diag R|)."""
  q, r = jnp.linalg.qr(q_dd + dt * (j_dd @ q_dd))
  return q, jnp.log(jnp.abs(jnp.diagonal(r)))


def _tangent_steps(jac_ldd, q_ldd, dt):
  """`_tangent_step` of every token: one batched QR, or on CPU one QR per token.

  jaxlib's CPU QR kernel splits a batch of matrices over XLA:CPU's intra-op thread pool
  and blocks its own pool thread until the parts are done; when a sharded program runs
  it on as many devices as the pool has threads, every thread waits and none is left to
  do the parts (a deadlock). One matrix per call is computed on the calling thread.
  """
  if jax.default_backend() == "cpu":
    return jax.lax.map(lambda jq: _tangent_step(*jq, dt), (jac_ldd, q_ldd))
  return jax.vmap(_tangent_step, in_axes=(0, 0, None))(jac_ldd, q_ldd, dt)


def tangent_exponents(
  field: Callable, x0_ld, step_weights, dt: float, position: int, chunk: int | None = None
):
  """Finite-time Lyapunov exponents of every input token for output `position`.

  Args:
    field: F(x_ld, p) -> [l, d].
    x0_ld: initial state.
    step_weights: pytree whose leaves are [K, …]: the field's params at each step.
    dt: step size; the exponents are divided by the total time K·dt.
    position: output position o (negative counts from the end).
    chunk: see `jacobian_row`.
  Returns:
    (exponents [l, d] — token i's spectrum, in QR column order — and the trajectory
    [K, l, d] of states before each step).
  """
  length, d = x0_ld.shape
  o = position % length
  num_steps = jax.tree.leaves(step_weights)[0].shape[0]

  def body(carry, p):
    x, q, logs = carry
    jac, f = jacobian_row(field, x, p, o, chunk)
    q, log_r = _tangent_steps(jac, q, dt)
    return (x + dt * f, q, logs + log_r), x

  q0 = jnp.broadcast_to(jnp.eye(d, dtype=x0_ld.dtype), (length, d, d))
  logs0 = jnp.zeros((length, d), x0_ld.dtype)
  (_, _, logs), traj = jax.lax.scan(body, (x0_ld, q0, logs0), step_weights)
  return logs / (num_steps * dt), traj


def attention_to(cfg, x_ld, p, position: int):
  """Attention probabilities [heads, l] of query `position` over all keys at one state
  (the same computation as `blocks.attention`, with the softmax kept)."""
  length = x_ld.shape[0]
  o = position % length
  xn = blocks.block_norm(x_ld, p, "norm1", cfg)
  q = jnp.einsum("td,dnh->tnh", xn, p["wq"])
  k = jnp.einsum("td,dnh->tnh", xn, p["wk"])
  if "bq" in p:
    q, k = q + p["bq"], k + p["bk"]
  if cfg.family == "llama":
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    q = blocks.rope(q[None], pos, cfg.rope_base)[0]
    k = blocks.rope(k[None], pos, cfg.rope_base)[0]
  scores = jnp.einsum("nh,snh->ns", q[o], k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
  scores = jnp.where(jnp.arange(length)[None] <= o, scores, -jnp.inf)
  return jax.nn.softmax(scores, axis=-1)


@dataclasses.dataclass
class Sensitivity:
  """Lyapunov and attention maps of one output position over a token sequence."""

  tokens: np.ndarray  # [l] ids
  position: int  # o, in [0, l)
  exponents: np.ndarray  # [l, d] finite-time spectrum of each input token
  scores: np.ndarray  # [l] max exponent (the token's Lyapunov score)
  attention: np.ndarray  # [l] attention of o to each token, mean over heads and steps
  attention_steps: np.ndarray  # [K, heads, l]
  trajectory: np.ndarray  # [K, l, d] states x_k before each step
  dt: float
  num_steps: int
  times: np.ndarray  # [K] t_k, or layer indices
  axis_label: str


def sensitivity(
  model,
  tokens_l: Sequence[int],
  position: int = -1,
  num_steps: int | None = None,
  chunk: int | None = None,
  dtype=jnp.float32,
) -> Sensitivity:
  """Lyapunov scores and the attention map of output `position` for one token sequence."""
  cfg = model.config
  tokens = np.asarray(tokens_l, np.int32)
  length = int(tokens.shape[0])
  if length == 0:
    raise ValueError("no tokens to analyse")
  if not -length <= position < length:
    raise ValueError(f"position={position} is outside the {length} tokens")
  if cfg.is_ode and cfg.solver != "euler":
    logging.warning(
      "model trained with solver=%r; analysing its Euler solve at K=%s steps",
      cfg.solver,
      num_steps or cfg.depth,
    )
  o = position % length
  steps = fields.euler_steps(model, num_steps, dtype)
  field = fields.vector_field(cfg, length)
  x0 = fields.embed(model, tokens, dtype)

  @jax.jit
  def run(x0, weights):
    exps, traj = tangent_exponents(field, x0, weights, steps.dt, o, chunk)
    att = jax.vmap(lambda x, p: attention_to(cfg, x, p, o))(traj, weights)
    return exps, att, traj

  exps, att, traj = run(x0, steps.weights)
  exps, att = loading.to_host(exps, np.float64), loading.to_host(att, np.float64)
  return Sensitivity(
    tokens=tokens,
    position=o,
    exponents=exps,
    scores=exps.max(-1),
    attention=att.mean(axis=(0, 1)),
    attention_steps=att,
    trajectory=loading.to_host(traj),
    dt=steps.dt,
    num_steps=len(steps.times),
    times=steps.times,
    axis_label=steps.axis_label,
  )


# ------------------------------------------------------------------------ tokenizer
def load_tokenizer(workdir: str, path: str | None = None):
  """`path` if given, else the run's tokenizer (`loading.load_tokenizer`)."""
  # lazy: importing input_pipeline pulls in grain and tensorflow_datasets (~2 s)
  from input_pipeline import tokenizer as tokenizer_lib

  if path:
    return tokenizer_lib.load(path, int(load_config(workdir).data.vocab_size))
  return loading.load_tokenizer(workdir)


def piece_text(sp, token_id: int) -> str:
  """A readable rendering of one piece ('▁' → space, byte pieces decoded)."""
  piece = sp.id_to_piece(int(token_id))
  m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
  if m:  # byte fallback: ASCII shown as itself; bytes of multi-byte UTF-8 stay <0xNN>
    byte = int(m.group(1), 16)
    ch = chr(byte)
    return {"\n": "↵", "\t": "⇥"}.get(ch, ch if byte < 0x80 and ch.isprintable() else piece)
  if sp.is_control(int(token_id)):
    return f"<{piece.strip('<>')}>"
  return piece.replace("▁", " ").replace("\n", "↵").replace("\t", "⇥")


# ---------------------------------------------------------------------------- output
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


# -------------------------------------------------------------------------------- CLI
def parse_args(argv):
  p = errors.ArgumentParser(
    prog="python -m odetransformer.analysis.lyapunov",
    description="Token sensitivity of one output position by Lyapunov exponents, "
    "beside the attention map.",
  )
  p.add_argument("--workdir", required=True, help="training run directory (main.py --workdir)")
  p.add_argument("--text", required=True, help="the text to analyse")
  p.add_argument(
    "--position",
    type=int,
    default=-1,
    help="output position o (token index; negative counts from the end)",
  )
  p.add_argument("--out", required=True, help="output directory (local or gs://...)")
  p.add_argument(
    "--solver_steps",
    type=int,
    default=None,
    help="Euler steps K for ODE models (default: the trained K)",
  )
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--mesh_shape", default="", help=loading.MESH_SHAPE_HELP)
  p.add_argument("--checkpoint_allow_unverified", action="store_true", help=UNVERIFIED_FLAG_HELP)
  p.add_argument("--tokenizer", default=None, help="SentencePiece .model (default: the run's)")
  p.add_argument(
    "--prepend_eos",
    action="store_true",
    help="put the document separator (eos) before the text, as in training",
  )
  p.add_argument(
    "--jacobian_chunk",
    type=int,
    default=None,
    help="pull back this many Jacobian rows at a time (bounds memory)",
  )
  known = {a.dest for a in p._actions}
  return p.parse_args(errors.renamed_flags(argv, known))


def main(argv: list | None = None) -> Sensitivity:
  """The command line; a bad flag or workdir is a UserError (one line: errors.run_cli)."""
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.solver_steps is not None and args.solver_steps <= 0:
    raise errors.UserError(
      f"--solver_steps={args.solver_steps} must be a positive number of "
      "Euler steps (or left out: the trained K)"
    )
  if args.jacobian_chunk is not None and args.jacobian_chunk <= 0:
    raise errors.UserError(f"--jacobian_chunk={args.jacobian_chunk} must be positive")
  loading.parse_mesh_shape(args.mesh_shape)
  loading.load_run_config(args.workdir)
  host.initialize_distributed()  # several processes: jax.distributed, as main.py
  loaded = loading.load_model(
    args.workdir,
    step=args.step,
    mesh_shape=args.mesh_shape,
    allow_unverified=args.checkpoint_allow_unverified,
  )
  cfg = loaded.model_config
  sp = load_tokenizer(args.workdir, args.tokenizer)
  # Undecodable bytes in argv arrive as lone surrogates, which SentencePiece rejects.
  text = args.text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
  ids = list(sp.encode(text))
  if args.prepend_eos:
    ids = [sp.eos_id()] + ids
  if not ids:
    raise errors.UserError("--text encodes to no tokens; pass some text (or --prepend_eos)")
  if cfg.family == "gpt2" and len(ids) > cfg.max_len:
    logging.warning("text is %d tokens; keeping the last model.max_len=%d", len(ids), cfg.max_len)
    ids = ids[-cfg.max_len :]
  if not -len(ids) <= args.position < len(ids):
    raise errors.UserError(
      f"--position={args.position} is outside the text's {len(ids)} "
      f"tokens; pass one in [{-len(ids)}, {len(ids) - 1}]"
    )
  res = sensitivity(loaded.model, ids, args.position, args.solver_steps, args.jacobian_chunk)
  pieces = [piece_text(sp, i) for i in ids]
  title = f"{cfg.kind} ({fileio.path(args.workdir).name}, step {loaded.step})"
  if jax.process_index() == 0:  # every process computed it; one writes
    paths = write_outputs(res, pieces, args.out, title)
    print(summary_line(res, pieces))
    print(f"wrote {', '.join(paths.values())}")
  return res


if __name__ == "__main__":
  errors.run_cli(main)
