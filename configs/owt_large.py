"""Paper: DiffEqFormer at GPT-large shape on OpenWebText (Table 3 / App. C.4, C.5).

Differs from owt_medium: 36 steps/layers, d 1280, 20 heads, MLP 5120, and AdamW
β2 = 0.95 (App. C.5: it lowered DiffEqFormer's validation perplexity at this size; GPT
did better with the default β2 — run the baseline with --config.optim.b2=0.999 to
reproduce that comparison).

  python main.py --config=configs/owt_large.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_large.py --config.model.kind=gpt --workdir=$W_gpt --config.data.data_dir=$DATA

Expect: DiffEqFormer below GPT-large in validation perplexity (paper Table 2, Fig. 7).
Not run by us (accelerator pod).
"""
from configs import owt_medium


def get_config():
  config = owt_medium.get_config()
  config.model.d_model = 1280
  config.model.num_heads = 20
  config.model.mlp_dim = 5120
  config.model.num_steps = 36
  config.optim.b2 = 0.95
  return config
