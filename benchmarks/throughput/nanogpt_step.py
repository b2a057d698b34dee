"""nanoGPT's train step, timed: the anchor `benchmarks.throughput --nanogpt=DIR` runs
beside our models, in a child process of its own (torch and jax never share the card).

  python -m benchmarks.throughput.nanogpt_step --nanogpt=DIR --batch=16 --seq_len=1024 \
      [--vocab=50304 --layers=12 --heads=12 --d_model=768]

DIR is a checkout of karpathy/nanoGPT: its `model.py` (GPT, GPTConfig) is imported from
there, never copied into this project. The step is nanoGPT's own recipe: bf16 autocast,
AdamW from `GPT.configure_optimizers` (fused on CUDA; weight decay 0.1, lr 6e-4,
β 0.9/0.95), gradient clipping at 1.0, `torch.compile` on CUDA (`--compile` forces it
either way), TF32 allowed, dropout 0, biases on. Random tokens, as our benchmark's.
The shape comes from the flags; nanoGPT's MLP is always 4 × d_model.

Prints progress lines, then one JSON line: ms_per_step, tokens_per_s, params, device,
torch version, compiled.
"""

import importlib.util
import json
import os
import statistics
import time

from odetransformer import cli_flags, errors


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("string", "nanogpt", None, "a nanoGPT checkout (holds model.py)", required=True)
  define("integer", "batch", None, "batch size", required=True)
  define("integer", "seq_len", None, "sequence length", required=True)
  define("integer", "vocab", 50304, "vocabulary size")
  define("integer", "layers", 12, "transformer layers")
  define("integer", "heads", 12, "attention heads")
  define("integer", "d_model", 768, "model width")
  define(
    "enum",
    "compile",
    "auto",
    "torch.compile the model (auto: on CUDA only)",
    enum_values=["auto", "yes", "no"],
  )
  define("integer", "warmup", 3, "untimed steps first")
  define("integer", "rounds", 5, "timed rounds")
  define("integer", "steps_per_round", 10, "steps per timed round")


def parse_args(argv=None):
  return cli_flags.parse_flags(define_flags, argv, doc=__doc__)


def load_nanogpt(directory: str):
  """nanoGPT's model module from `directory`/model.py."""
  path = os.path.join(directory, "model.py")
  if not os.path.isfile(path):
    raise errors.UserError(
      f"--nanogpt={directory} holds no model.py; pass a checkout of karpathy/nanoGPT"
    )
  spec = importlib.util.spec_from_file_location("nanogpt_model", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(argv=None):
  args = parse_args(argv)
  try:
    import torch  # lazy: optional, only this anchor needs it
  except ImportError:
    raise errors.UserError(
      "--nanogpt needs torch; pip install torch (the CUDA build on a GPU host)"
    ) from None
  nano = load_nanogpt(args.nanogpt)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cuda.matmul.allow_tf32 = True
  torch.backends.cudnn.allow_tf32 = True
  torch.manual_seed(0)
  cfg = nano.GPTConfig(
    block_size=args.seq_len,
    vocab_size=args.vocab,
    n_layer=args.layers,
    n_head=args.heads,
    n_embd=args.d_model,
    dropout=0.0,
    bias=True,
  )
  model = nano.GPT(cfg).to(device)
  opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device)
  compiled = args.compile == "yes" or (args.compile == "auto" and device == "cuda")
  if compiled:
    model = torch.compile(model)
  x = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
  y = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  def step():
    with torch.autocast(device, dtype=torch.bfloat16):
      _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  start = time.perf_counter()
  for _ in range(args.warmup):
    step()
  sync()
  print(f"nanogpt: compile and warm-up {time.perf_counter() - start:.1f}s", flush=True)
  secs = []
  for _ in range(args.rounds):
    sync()
    start = time.perf_counter()
    for _ in range(args.steps_per_round):
      loss = step()
    sync()
    secs.append((time.perf_counter() - start) / args.steps_per_round)
  if not torch.isfinite(loss):
    raise SystemExit(f"error: nanoGPT's loss is {loss.item()}; the anchor did not train")
  sec = statistics.median(secs)
  print(
    json.dumps(
      {
        "ms_per_step": sec * 1e3,
        "tokens_per_s": args.batch * args.seq_len / sec,
        "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "compiled": compiled,
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  errors.run_cli(main)
