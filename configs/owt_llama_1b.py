"""Paper: Llama-flavoured DiffEqFormer at Llama-1B shape on OpenWebText (Table 3, C.6).

Differs from owt_large: the llama flavour (RMSNorm, RoPE, SwiGLU with three
time-dependent matrices, no biases), 16 steps/layers, d 2048, 16 heads, MLP 8192,
vocabulary 32,000 (Llama's size; SentencePiece trained on the training split),
untied embeddings as in Llama. β2 = 0.95 as for large.

  python main.py --config=configs/owt_llama_1b.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_llama_1b.py --config.model.kind=gpt --workdir=$W_gpt --config.data.data_dir=$DATA
(`kind=gpt` with flavour 'llama' is the discrete Llama baseline.)

Expect: DiffEqFormer clearly below the Llama-1B baseline in validation perplexity
(paper Table 2, Fig. 8). Not run by us (8 × H100 in the paper).
"""
from configs import owt_large


def get_config():
  config = owt_large.get_config()
  config.model.flavour = "llama"
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.mlp_dim = 8192
  config.model.num_steps = 16
  config.model.tie_embeddings = False
  config.data.vocab_size = 32000
  return config
