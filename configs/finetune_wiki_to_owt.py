"""Paper Fig. 5 (right): pre-train on WikiText-103 with 18 steps at GPT-medium width,
fine-tune on OpenWebText with N ∈ {9, 12, 18, 24} steps, each method.

From the authors' config/finetune/wiki_owt.yaml (SDML-KU/qkvflow): the same settings
as finetune_owt_to_wiki.py with the two corpora swapped.

  python main.py --config=configs/wikitext103_medium.py --workdir=$PRE \
      --config.data.data_dir=$DATA --config.model.solver_steps=18 \
      --config.model.time_embed_dim=100 --config.model.time_sinusoids=256
  python main.py --config=configs/wikitext103_medium.py --workdir=$PRE_GPT \
      --config.data.data_dir=$DATA --config.model.kind=transformer --config.model.num_layers=24
  python main.py --config=configs/finetune_wiki_to_owt.py --workdir=$W_${METHOD}_$N \
      --config.init_from=$PRE --config.finetune.method=$METHOD \
      --config.finetune.solver_steps=$N --config.data.data_dir=$DATA

Expect: as finetune_owt_to_wiki.py, in the other direction. Not run by us.
"""

from configs import finetune_owt_to_wiki, owt_medium


def get_config():
  config = owt_medium.get_config()
  source = finetune_owt_to_wiki.get_config()
  config.init_from = source.init_from
  config.finetune = source.finetune
  config.num_train_steps = source.num_train_steps
  config.eval_every_steps = source.eval_every_steps  # the yaml's steps_per_eval: 200
  config.optim.learning_rate = source.optim.learning_rate
  for key in ("time_embed_dim", "time_sinusoids"):
    config.model[key] = source.model[key]
  return config
