"""Ours: a Llama-family DiffEqFormer at the Llama-1B shape on OpenWebText.

Not one of the authors' runs as configured: their config/owt/llama_1b.yaml
(SDML-KU/qkvflow) sets `model_choice: llama`, which trains the discrete Llama
(configs/owt_llama_1b.py). This config keeps everything of that file and baseline —
16 steps, d 2048, 16 heads, MLP 8192, sequence 2048, batch 256, 40,001 steps, lr 3e-4,
AdamW β2 0.95, ε 1e-8, weight decay 1e-5, no dropout, untied head — and makes the
model a DiffEqFormer with the time_embed_dim 96 and sinusodial_dim 256 the file carries
(the llama family: RMSNorm, RoPE, SwiGLU with three time-dependent matrices, no
biases). Weight decay on the embeddings only, as for the authors' ODE runs.

  python main.py --config=configs/owt_llama_1b_ode.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_llama_1b.py --workdir=$W_llama \
      --config.data.data_dir=$DATA   # the baseline

Expect: DiffEqFormer below the Llama-1B baseline in validation perplexity (the paper's
Table 2 and Fig. 8 report such a comparison). Not run by us (8 × H100 in the paper).
"""

from configs import owt_llama_1b


def get_config():
  config = owt_llama_1b.get_config()
  config.model.kind = "diffeqformer"
  config.model.time_embed_dim = 96  # d_t
  config.model.time_sinusoids = 256  # S
  config.model.time_hidden = 0
  return config
