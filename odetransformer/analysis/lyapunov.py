"""Token-level sensitivity by finite-time Lyapunov exponents (paper §5.2, Fig. 3, App. B, F).

    python -m odetransformer.analysis.lyapunov --workdir=W --text="..." [--position=-1] --out=DIR

writes DIR/lyapunov.json (scores), DIR/lyapunov.npz (full spectra), DIR/lyapunov.html
and DIR/lyapunov.png (the text coloured by each map, side by side). The model loads on
the run's mesh (or --mesh_shape=1,-1,1 ...), under `jax.distributed` when launched as
several processes; process 0 writes.

This module is the command line and the tokenizer's side (the text's pieces); the
computation is `lyapunov_exponents` (the method is described there), the maps' files and
summary `lyapunov_report`. Their public names are importable from here too.
"""

import re

from absl import logging
import jax

from odetransformer import cli_flags, errors

# Re-exported: tests and benchmarks/single_epoch/analysis.py use them as lyapunov.NAME.
from odetransformer.analysis.lyapunov_exponents import (  # noqa: F401
  Sensitivity,
  attention_to,
  jacobian_row,
  sensitivity,
  tangent_exponents,
)
from odetransformer.analysis.lyapunov_report import (  # noqa: F401
  colour_scale,
  context_indices,
  map_correlation,
  render_html,
  render_png,
  spearman,
  summary_line,
  write_outputs,
)
from odetransformer.runtime import fileio, host
from odetransformer.train import loading


# ------------------------------------------------------------------------ tokenizer
def load_tokenizer(workdir: str, path: str | None = None):
  """`path` if given, else the run's tokenizer (`loading.load_tokenizer`)."""
  # lazy: importing input_pipeline pulls in grain and tensorflow_datasets (~2 s)
  from input_pipeline import tokenizer as tokenizer_lib

  if path:
    return tokenizer_lib.load(path, loading.load_run_config(workdir).data.vocab_size)
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


# -------------------------------------------------------------------------------- CLI
def define_flags(define) -> None:
  """This command's flags (`cli_flags.parse_flags`); the loading ones from
  `loading.define_load_flags`."""
  define("string", "text", None, "The text to analyse.", required=True)
  define(
    "integer", "position", -1, "Output position o (token index; negative counts from the end)."
  )
  define("string", "out", None, "Output directory (local or gs://...).", required=True)
  define("integer", "solver_steps", None, "Euler steps K for ODE models (default: the trained K).")
  define(
    "string",
    "tokenizer",
    None,
    "Tokenizer file: a SentencePiece .model or a tokenizer.json (default: the run's).",
  )
  define(
    "bool",
    "prepend_eos",
    False,
    "Put the document separator (eos) before the text, as in training.",
  )
  define(
    "integer",
    "jacobian_chunk",
    None,
    "Pull back this many Jacobian rows at a time (bounds memory).",
  )
  loading.define_load_flags(define)


def parse_args(argv):
  """The flags of `argv` (without the program name; None: sys.argv[1:]); the old
  --num_steps still parses as --solver_steps, with a warning (`cli_flags.parse_flags`)."""
  return cli_flags.parse_flags(
    define_flags,
    argv,
    doc="Token sensitivity of one output position by Lyapunov exponents, beside the attention map.",
  )


def main(argv: list | None = None) -> Sensitivity:
  """The command line; a bad flag or workdir is a UserError (one line: errors.run_cli)."""
  args = parse_args(argv)  # None: sys.argv[1:]
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
