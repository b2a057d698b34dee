"""Input pipeline: TFDS/array_record sources, SentencePiece tokenizer, grain batches.

    ds = create_datasets(config.data, seq_len=..., global_batch_size=..., eval_batch_size=...,
                         seed=..., workdir=...)
    it = iter(ds.train); batch = next(it)          # dict of [local_batch, seq_len] numpy arrays
    text = json.dumps(it.get_state()); restore_iterator_state(it2, json.loads(text))

Configuration: `input_pipeline.config.get_config()`; bad input raises `DataError`.
"""

from input_pipeline.errors import DataError
from input_pipeline.pipeline import Datasets, create_datasets, restore_iterator_state

__all__ = ["DataError", "Datasets", "create_datasets", "restore_iterator_state"]
