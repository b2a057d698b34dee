"""A run's SentencePiece BPE model as a Hugging Face `tokenizer.json` (same ids).

Written from the model proto alone (no transformers needed): the vocabulary with the
SentencePiece ids, merges ordered as SentencePiece applies them (the pair whose merged
piece scores highest first), byte fallback, the dummy-prefix '▁' and spaces as '▁'.
The special pieces (<pad>, <unk>, <s>, </s>) are special tokens of the tokenizer, and
`split_special_tokens` keeps their spellings in text ordinary characters, as
SentencePiece reads them ("<unk>" in a text is five characters, not id 1). The
beginning-of-sequence token is the end-of-text one, as GPT-2's: training never uses
<s>; a document follows the previous one's </s>, so that is the context a model has
seen before a document's first token (lm-evaluation-harness conditions on the `bos`
token).

Only what `input_pipeline.tokenizer.train` makes is converted (BPE, identity
normalisation, no whitespace squeezing); another model is a one-line UserError. A run
whose tokenizer already is a Hugging Face tokenizer.json (an imported model's) exports
that file as it is, with its document separator as bos and eos.
"""

import json

from sentencepiece import sentencepiece_model_pb2

from odetransformer.errors import UserError
from odetransformer.train.checkpoint.paths import is_hf_tokenizer

SPACE = "\u2581"  # '▁', SentencePiece's whitespace
_PIECE = sentencepiece_model_pb2.ModelProto.SentencePiece


def _check(proto, where: str) -> None:
  trainer, norm = proto.trainer_spec, proto.normalizer_spec
  problems = []
  if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
    problems.append("a BPE model")
  if norm.name not in ("identity", "") or norm.precompiled_charsmap:
    problems.append(f"identity normalisation (it has {norm.name!r})")
  if norm.remove_extra_whitespaces:
    problems.append("remove_extra_whitespaces=false")
  if not norm.escape_whitespaces or trainer.treat_whitespace_as_suffix:
    problems.append("whitespace escaped as a '▁' prefix")
  if problems:
    raise UserError(
      f"the tokenizer {where} cannot be exported as a Hugging Face tokenizer "
      f"with the same ids: export needs {', '.join(problems)}, as "
      "input_pipeline.tokenizer trains them; train the run's tokenizer that way"
    )


def _hf_separator(blob: bytes):
  """(token, id) of a Hugging Face tokenizer.json's document separator."""
  from input_pipeline import tokenizer as tokenizer_lib  # lazy: grain and tfds (~2 s)

  tok = tokenizer_lib.HFTokenizer(blob)
  return tok.id_to_piece(tok.eos_id()), tok.eos_id()


def special_ids(model_proto: bytes) -> dict:
  """{'bos_token_id': .., 'eos_token_id': .., 'pad_token_id': ..} of a SentencePiece
  model (None where it has none), or of a tokenizer.json; bos is eos (module docstring)."""
  if is_hf_tokenizer(model_proto):
    _, eos = _hf_separator(model_proto)
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}
  trainer = sentencepiece_model_pb2.ModelProto.FromString(model_proto).trainer_spec
  return {
    f"{k}_token_id": (i if i >= 0 else None)
    for k, i in (("bos", trainer.eos_id), ("eos", trainer.eos_id), ("pad", trainer.pad_id))
  }


def tokenizer_files(model_proto: bytes, model_max_length: int, where: str = "") -> dict:
  """{file name: text} of the Hugging Face tokenizer of a SentencePiece BPE model;
  `model_max_length`: the model's context in tokens. A tokenizer.json is written as
  it is."""
  if is_hf_tokenizer(model_proto):
    sep, _ = _hf_separator(model_proto)
    config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "model_max_length": model_max_length,
      "clean_up_tokenization_spaces": False,
      "add_bos_token": False,
      "add_eos_token": False,
      "bos_token": sep,
      "eos_token": sep,
    }
    return {
      "tokenizer.json": model_proto.decode("utf-8"),
      "tokenizer_config.json": json.dumps(config, indent=2),
    }
  proto = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
  _check(proto, where)
  pieces = list(proto.pieces)
  vocab = {p.piece: i for i, p in enumerate(pieces)}
  special = [i for i, p in enumerate(pieces) if p.type in (_PIECE.CONTROL, _PIECE.UNKNOWN)]
  # A merge (l, r) -> l + r for every normal piece and every split of it into two
  # pieces; SentencePiece merges the adjacent pair whose result scores highest.
  merges = []
  for i, p in enumerate(pieces):
    if p.type != _PIECE.NORMAL or len(p.piece) < 2:
      continue
    for cut in range(1, len(p.piece)):
      left, right = p.piece[:cut], p.piece[cut:]
      if left in vocab and right in vocab:
        merges.append((-p.score, i, vocab[left], vocab[right], left, right))
  merges.sort()

  def token(i):
    return {
      "id": i,
      "content": pieces[i].piece,
      "single_word": False,
      "lstrip": False,
      "rstrip": False,
      "normalized": False,
      "special": True,
    }

  norm = proto.normalizer_spec
  normalizers = [{"type": "Prepend", "prepend": SPACE}] if norm.add_dummy_prefix else []
  normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
  decoders = [
    {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
  ]
  if norm.add_dummy_prefix:
    decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
  trainer = proto.trainer_spec
  unk = pieces[trainer.unk_id].piece
  tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [token(i) for i in special],
    "normalizer": {"type": "Sequence", "normalizers": normalizers},
    "pre_tokenizer": None,
    "post_processor": None,
    "decoder": {"type": "Sequence", "decoders": decoders},
    "model": {
      "type": "BPE",
      "dropout": None,
      "unk_token": unk,
      "continuing_subword_prefix": None,
      "end_of_word_suffix": None,
      "fuse_unk": True,
      "byte_fallback": True,
      "ignore_merges": False,
      "vocab": vocab,
      "merges": [[m[4], m[5]] for m in merges],
    },
  }
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": model_max_length,
    "clean_up_tokenization_spaces": False,
    "split_special_tokens": True,
    "add_bos_token": False,
    "add_eos_token": False,
    "pad_token": pieces[trainer.pad_id].piece if trainer.pad_id >= 0 else None,
    "unk_token": unk,
    "bos_token": pieces[trainer.eos_id].piece if trainer.eos_id >= 0 else None,
    "eos_token": pieces[trainer.eos_id].piece if trainer.eos_id >= 0 else None,
  }
  return {
    "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
    "tokenizer_config.json": json.dumps(config, indent=2),
  }
