"""Paper: DiffEqFormer at GPT-medium shape on WikiText-103 (Table 1 / App. C.4).

From the authors' config/wikitext_103/medium.yaml (SDML-KU/qkvflow), which as
committed sets `model_choice: gpt2` (their GPT-2 baseline run, `--config.model.kind=transformer`
here) and carries the DiffEqFormer's time_embed_dim and sinusodial_dim, used here.
Differs from wikitext103_small: 24 steps/layers, d 1024, 16 heads, MLP 4096, d_t 48,
peak lr 3e-4.

  python main.py --config=configs/wikitext103_medium.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/wikitext103_medium.py --config.model.kind=transformer \
      --workdir=$W_gpt --config.data.data_dir=$DATA

Expect: GPT-medium overfits (validation perplexity turns up late in training) while
DiffEqFormer-medium does not, and ends lower (paper Table 1, Fig. 4). Not run by us.
"""

from configs import wikitext103_small


def get_config():
  config = wikitext103_small.get_config()
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.mlp_dim = 4096
  config.model.solver_steps = 24  # K
  config.model.num_layers = 24  # L (the baseline)
  config.model.time_embed_dim = 48
  config.optim.learning_rate = 3e-4
  return config
