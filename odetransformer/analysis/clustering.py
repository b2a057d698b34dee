"""Do tokens cluster? The attention-only simulation of the paper's App. C.8 (Fig. 2c/d, 13).

Setting (one head, no MLP, no norms, full — not causal — attention, as in Geshkovski
et al. 2023): n = 40 tokens in d = 3, drawn uniformly in the cube [-1, 1]^3 and projected
to the unit sphere; 200 Euler steps of length dt = T/200 with T = 10 (dt = 0.05), each
followed by the projection back to the sphere (Geshkovski et al.'s dynamics on S^{d-1}):

    x_i ← normalise(x_i + dt·Σ_j softmax_j(⟨Q(t) x_i, K(t) x_j⟩)·V(t) x_j),

with no 1/√d score scale. Every weight is W(t) = β(t)·W0, so the scores scale with β²
and the values with β. Cases:

  identity  Q0 = K0 = V0 = I, β = 1: Geshkovski et al.'s setting (one cluster forms).
  shared    random W0 (entries N(0, 1)), β = 1: weight sharing.
  poly1/2/4 random W0, β(t) = 1 + (β_end − 1)·(t/T)^p, p = 1, 2, 4 (β_end = 10): weights
            growing in magnitude towards the end, the later and steeper the higher p,
            mimicking the trained DiffEqFormer's spectra (paper §5.1).

Dispersion (DESIGN: "a number per case"): the mean pairwise distance
(1/(n(n−1)))·Σ_{i≠j}|x_i − x_j| of the tokens (≈ 1.33 for points spread over the sphere,
0 for one cluster); also 1 − |mean_i x_i| (0 for one cluster, ~1 when spread or for
antipodal clusters) and the number of clusters (groups closer than 0.05, single linkage).
Random weights are drawn `num_draws` times; the plots show draw 0 and the summary also
gives the median over draws, because with random W0 the outcome depends on the draw.

    python -m odetransformer.analysis.clustering --out=DIR [--num_draws=8] [--seed=0]

writes DIR/clustering.json, DIR/clustering.npz, DIR/clustering.png (3-D trajectories)
and DIR/clustering_dispersion.png (dispersion vs t).
"""

from collections.abc import Callable, Sequence
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from odetransformer import cli_flags, errors
from odetransformer.runtime import fileio

NUM_TOKENS = 40
DIM = 3
NUM_STEPS = 200
HORIZON = 10.0  # T; dt = T / NUM_STEPS = 0.05
BETA_END = 10.0  # β(T) of the polynomial cases
CLUSTER_TOL = 0.05  # distance under which two tokens are in one cluster
CASES = ("identity", "shared", "poly1", "poly2", "poly4")


# --------------------------------------------------------------------------- dynamics
def attention_field(x_nd, q_dd, k_dd, v_dd, causal: bool = False):
  """Σ_j softmax_j(⟨Q x_i, K x_j⟩)·V x_j for all i: [n, d]."""
  scores = (x_nd @ q_dd.T) @ (x_nd @ k_dd.T).T
  if causal:
    n = x_nd.shape[0]
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
  return jax.nn.softmax(scores, axis=-1) @ (x_nd @ v_dd.T)


def normalise(x_nd):
  return x_nd / jnp.linalg.norm(x_nd, axis=-1, keepdims=True)


def simulate(
  x0_nd,
  q0,
  k0,
  v0,
  beta: Callable,
  horizon: float = HORIZON,
  num_steps: int = NUM_STEPS,
  causal: bool = False,
):
  """Trajectory [num_steps + 1, n, d] of x ← normalise(x + dt·attn_{β(t)W0}(x)).

  `x0_nd` is projected to the sphere first; `beta(t)` is a jnp-traceable scalar.
  """
  dt = horizon / num_steps

  def body(x, t):
    b = beta(t)
    x = normalise(x + dt * attention_field(x, b * q0, b * k0, b * v0, causal))
    return x, x

  x0 = normalise(jnp.asarray(x0_nd))
  ts = dt * jnp.arange(num_steps, dtype=x0.dtype)
  _, traj = jax.lax.scan(body, x0, ts)
  return jnp.concatenate([x0[None], traj])


def beta_polynomial(order, horizon: float = HORIZON, beta_end: float = BETA_END):
  """β(t) = 1 + (β_end − 1)·(t/T)^order; order 0 is the constant 1 (weight sharing).

  `order` may be a traced scalar (all cases then share one compiled simulation).
  """

  def beta(t):
    grown = 1.0 + (beta_end - 1.0) * (t / horizon) ** order
    return jnp.where(order == 0, jnp.ones_like(grown), grown)

  return beta


def case_setup(case: str, key):
  """(Q0, K0, V0, polynomial order of β) of one case; `key` draws the random weights."""
  if case == "identity":
    eye = jnp.eye(DIM)
    return eye, eye, eye, 0
  kq, kk, kv = jax.random.split(key, 3)
  q0, k0, v0 = (jax.random.normal(k, (DIM, DIM)) for k in (kq, kk, kv))
  if case == "shared":
    return q0, k0, v0, 0
  if case.startswith("poly") and case[4:].isdigit():
    return q0, k0, v0, int(case[4:])
  raise ValueError(f"unknown case {case!r}; choose from {CASES} (or polyN)")


# ------------------------------------------------------------------------- dispersion
def mean_pairwise_distance(x_nd) -> float:
  x = np.asarray(x_nd, np.float64)
  n = x.shape[0]
  d = np.linalg.norm(x[:, None] - x[None], axis=-1)
  return float(d.sum() / (n * (n - 1)))


def polarisation_gap(x_nd) -> float:
  """1 − |mean of the unit vectors|."""
  x = np.asarray(x_nd, np.float64)
  u = x / np.linalg.norm(x, axis=-1, keepdims=True)
  return float(1.0 - np.linalg.norm(u.mean(0)))


def num_clusters(x_nd, tol: float = CLUSTER_TOL) -> int:
  """Connected components of the graph linking tokens closer than `tol`."""
  x = np.asarray(x_nd, np.float64)
  close = np.linalg.norm(x[:, None] - x[None], axis=-1) < tol
  label = -np.ones(len(x), int)
  count = 0
  for s in range(len(x)):
    if label[s] >= 0:
      continue
    stack, label[s] = [s], count
    while stack:
      i = stack.pop()
      for j in np.flatnonzero(close[i] & (label < 0)):
        label[j] = count
        stack.append(j)
    count += 1
  return count


@dataclasses.dataclass
class CaseResult:
  case: str
  trajectory: np.ndarray  # [S + 1, n, d] (draw 0)
  beta: np.ndarray  # [S] β(t_k)
  dispersion: np.ndarray  # [S + 1] mean pairwise distance along t (draw 0)
  initial: float  # mean pairwise distance at t = 0
  final: float  # at t = T (draw 0)
  final_polarisation_gap: float  # 1 − |mean x| at t = T (draw 0)
  final_clusters: int  # at t = T (draw 0)
  final_draws: np.ndarray  # [draws] final mean pairwise distance per weight draw

  def numbers(self) -> dict:
    return {
      "initial_dispersion": self.initial,
      "final_dispersion": self.final,
      "ratio_final_to_initial": self.final / self.initial,
      "final_polarisation_gap": self.final_polarisation_gap,
      "final_clusters": self.final_clusters,
      "final_dispersion_draws": self.final_draws.tolist(),
      "final_dispersion_median_over_draws": float(np.median(self.final_draws)),
      "beta_start": float(self.beta[0]),
      "beta_end": float(self.beta[-1]),
    }


def initial_tokens(key, num_tokens: int = NUM_TOKENS):
  """Uniform in the cube [-1, 1]^3 (projected to the sphere by `simulate`)."""
  return jax.random.uniform(key, (num_tokens, DIM), minval=-1.0, maxval=1.0)


def run_cases(
  cases: Sequence[str] = CASES,
  seed: int = 0,
  num_draws: int = 8,
  horizon: float = HORIZON,
  num_steps: int = NUM_STEPS,
  beta_end: float = BETA_END,
  num_tokens: int = NUM_TOKENS,
  causal: bool = False,
) -> dict:
  """Simulates every case from the same initial tokens: case -> CaseResult."""
  key_x, key_w = jax.random.split(jax.random.key(seed))
  x0 = initial_tokens(key_x, num_tokens)
  dt = horizon / num_steps
  ts = dt * jnp.arange(num_steps, dtype=jnp.float32)
  draw_keys = jax.random.split(key_w, max(1, num_draws))
  setups = [[case_setup(case, k) for k in draw_keys] for case in cases]
  stack = lambda i: jnp.asarray([[s[i] for s in row] for row in setups], jnp.float32)
  q0, k0, v0, order = stack(0), stack(1), stack(2), stack(3)  # [cases, draws, …]

  def one(q, k, v, p):
    beta = beta_polynomial(p, horizon, beta_end)
    return simulate(x0, q, k, v, beta, horizon, num_steps, causal), beta(ts)

  trajs, betas = jax.jit(jax.vmap(jax.vmap(one)))(q0, k0, v0, order)
  trajs, betas = np.asarray(trajs, np.float64), np.asarray(betas, np.float64)
  out = {}
  for c, case in enumerate(cases):
    traj = trajs[c, 0]
    disp = np.array([mean_pairwise_distance(x) for x in traj])
    out[case] = CaseResult(
      case=case,
      trajectory=traj,
      beta=betas[c, 0],
      dispersion=disp,
      initial=float(disp[0]),
      final=float(disp[-1]),
      final_polarisation_gap=polarisation_gap(traj[-1]),
      final_clusters=num_clusters(traj[-1]),
      final_draws=np.array([mean_pairwise_distance(t[-1]) for t in trajs[c]]),
    )
  return out


def summary_line(results: dict) -> str:
  parts = [
    f"{c} {r.initial:.3g}→{r.final:.3g} ({r.final_clusters} cl; median over "
    f"{len(r.final_draws)} draws {np.median(r.final_draws):.3g})"
    for c, r in results.items()
  ]
  return "clustering: mean pairwise distance t=0→T: " + "; ".join(parts)


# ------------------------------------------------------------------------------ plots
def plot_trajectories(results: dict, path: str, horizon: float = HORIZON) -> None:
  import matplotlib  # lazy: matplotlib only for the plots

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

  cases = list(results)
  fig = plt.figure(figsize=(3.6 * len(cases), 4.2))
  u, v = np.mgrid[0 : 2 * np.pi : 30j, 0 : np.pi : 15j]
  sphere = (np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v))
  colors = plt.cm.tab10(np.arange(len(cases)) % 10)
  for idx, case in enumerate(cases):
    r = results[case]
    ax = fig.add_subplot(1, len(cases), idx + 1, projection="3d")
    ax.plot_wireframe(*sphere, color="0.85", lw=0.3)
    traj = r.trajectory
    for i in range(traj.shape[1]):
      ax.plot(
        traj[:, i, 0], traj[:, i, 1], traj[:, i, 2], color=colors[idx], lw=0.7, alpha=0.5, ls="--"
      )
    ax.scatter(*traj[0].T, facecolors="white", edgecolors="tab:blue", s=18, label="t = 0")
    ax.scatter(*traj[-1].T, color=colors[idx], edgecolors="black", s=22, label=f"t = {horizon:g}")
    ax.set_title(
      f"{case}: β {r.beta[0]:.3g}→{r.beta[-1]:.3g}\n"
      f"dispersion {r.initial:.2f}→{r.final:.3g}, {r.final_clusters} cluster(s)",
      fontsize=9,
    )
    ax.set_box_aspect((1, 1, 1))
    ax.set_xticks([-1, 0, 1])
    ax.set_yticks([-1, 0, 1])
    ax.set_zticks([-1, 0, 1])
    ax.tick_params(labelsize=6)
    if idx == 0:
      ax.legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  fileio.write_figure(path, fig, dpi=110)
  plt.close(fig)


def plot_dispersion(results: dict, path: str, horizon: float = HORIZON) -> None:
  import matplotlib  # lazy: matplotlib only for the plots

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

  fig, ax = plt.subplots(figsize=(6, 3.8))
  for case, r in results.items():
    t = np.linspace(0.0, horizon, len(r.dispersion))
    ax.plot(t, r.dispersion, label=case)
  ax.set_yscale("symlog", linthresh=1e-3)
  ax.set_xlabel("t")
  ax.set_ylabel("mean pairwise distance")
  ax.set_title("token dispersion (draw 0)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fileio.write_figure(path, fig, dpi=110)
  plt.close(fig)


def write_outputs(results: dict, out_dir: str, settings: dict) -> dict:
  """clustering.json, clustering.npz and the two PNGs in `out_dir` (a local directory or
  a URL such as gs://...); returns name -> path."""
  paths = {
    "json": fileio.join(out_dir, "clustering.json"),
    "npz": fileio.join(out_dir, "clustering.npz"),
    "png": fileio.join(out_dir, "clustering.png"),
    "dispersion_png": fileio.join(out_dir, "clustering_dispersion.png"),
  }
  fileio.write_text_atomic(
    paths["json"],
    json.dumps(
      {
        "settings": settings,
        "cases": {c: r.numbers() for c, r in results.items()},
        "summary": summary_line(results),
      },
      indent=1,
    ),
  )
  arrays = {}
  for c, r in results.items():
    arrays[f"{c}_trajectory"] = r.trajectory
    arrays[f"{c}_beta"] = r.beta
    arrays[f"{c}_dispersion"] = r.dispersion
  fileio.write_npz(paths["npz"], **arrays)
  plot_trajectories(results, paths["png"], settings["horizon"])
  plot_dispersion(results, paths["dispersion_png"], settings["horizon"])
  return paths


# -------------------------------------------------------------------------------- CLI
def define_flags(define) -> None:
  """This command's flags (`cli_flags.parse_flags`)."""
  define("string", "out", None, "Output directory (local or gs://...).", required=True)
  define("integer", "seed", 0, "Initial tokens and weight draws.")
  define("integer", "num_draws", 8, "Random W0 draws per case.")
  define("float", "horizon", HORIZON, "T (dt = T / num_steps).")
  define("integer", "num_steps", NUM_STEPS, "Euler steps over [0, T].")
  define("float", "beta_end", BETA_END, "β(T) of the polynomials.")
  define("integer", "num_tokens", NUM_TOKENS, "Tokens n on the sphere.")
  define("string", "cases", ",".join(CASES), f"Comma list from {CASES}.")
  define("bool", "causal", False, "Causal instead of full attention.")


def parse_args(argv):
  """The flags of `argv` (without the program name; None: sys.argv[1:])."""
  return cli_flags.parse_flags(
    define_flags,
    argv,
    doc="App. C.8: attention-only token dynamics on the sphere, weights β(t)·W0.",
  )


def main(argv: list | None = None) -> dict:
  """The command line; a bad flag is a UserError (one line: errors.run_cli)."""
  args = parse_args(argv)  # None: sys.argv[1:]
  cases = [c for c in args.cases.split(",") if c]
  unknown = [c for c in cases if c not in CASES and not (c.startswith("poly") and c[4:].isdigit())]
  if unknown or not cases:
    raise errors.UserError(
      f"--cases={args.cases!r}: unknown {unknown or 'none given'}; "
      f"choose from {list(CASES)} (or polyN)"
    )
  for name in ("num_steps", "num_tokens", "num_draws"):
    if getattr(args, name) <= 0:
      raise errors.UserError(f"--{name}={getattr(args, name)} must be positive")
  if not args.horizon > 0:
    raise errors.UserError(f"--horizon={args.horizon} must be positive")
  settings = {
    "num_tokens": args.num_tokens,
    "dim": DIM,
    "num_steps": args.num_steps,
    "horizon": args.horizon,
    "dt": args.horizon / args.num_steps,
    "beta_end": args.beta_end,
    "seed": args.seed,
    "num_draws": args.num_draws,
    "causal": args.causal,
    "init": "uniform in [-1, 1]^3, projected to the sphere",
    "dispersion": "mean pairwise distance",
  }
  results = run_cases(
    cases,
    args.seed,
    args.num_draws,
    args.horizon,
    args.num_steps,
    args.beta_end,
    args.num_tokens,
    args.causal,
  )
  paths = write_outputs(results, args.out, settings)
  print(summary_line(results))
  print(f"wrote {', '.join(paths.values())}")
  return results


if __name__ == "__main__":
  errors.run_cli(main)
