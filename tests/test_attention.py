"""Attention kernels (`model.attention_impl`): each against a float64 numpy reference,
packed documents (segment ids) included; the kernel choice per platform and its errors.

XLA runs everywhere. Splash is a Pallas TPU kernel: on CPU it runs in Pallas'
interpreter (the same kernel program, interpreted); compiled only on a TPU. cuDNN
needs an NVIDIA GPU. The tests of a platform's own kernel skip elsewhere, saying why;
the suite runs on CPU (conftest), so run them with JAX_PLATFORMS=cuda or tpu there.
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from odetransformer.errors import ConfigError
from odetransformer.model import blocks
from odetransformer.model import config as config_lib
from odetransformer.train import sharding

from tiny import run_on_8_cpu_devices

PLATFORM = blocks._platform()


def reference_attention(q, k, v, segment_ids):
  """Causal softmax attention within documents, in float64 numpy: [b, t, n, h]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, h = q.shape[1], q.shape[-1]
  scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  allowed = np.tril(np.ones((t, t), bool))[None, None]
  if segment_ids is not None:
    seg = np.asarray(segment_ids)
    allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
  scores = np.where(allowed, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


def _inputs(b=2, t=128, n=2, h=16, dtype=np.float32):
  """q, k, v and packed segment ids: row 0 holds three documents, row 1 one."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((b, t, n, h)).astype(dtype) for _ in range(3))
  seg = np.ones((b, t), np.int32)
  seg[0, t // 3 :] = 2
  seg[0, t // 2 + 5 :] = 3
  return q, k, v, seg


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("packed", [True, False])
def test_xla_kernel_equals_the_reference(packed):
  q, k, v, seg = _inputs(t=48)
  mask = blocks.attention_mask(jnp.asarray(seg) if packed else None)
  out = jax.jit(lambda q, k, v: blocks.dot_product_attention(q, k, v, mask, "xla"))(q, k, v)
  want = reference_attention(q, k, v, seg if packed else None)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
  if packed:  # the documents really are apart: unpacked attention differs
    assert np.max(np.abs(want - reference_attention(q, k, v, None))) > 0.1


@pytest.mark.matmul_precision("highest")
def test_model_attention_runs_the_configured_kernel_on_packed_rows():
  """`blocks.attention` (the model's) with attention_impl 'xla' and 'auto' (xla on CPU)
  equals the reference after the projections."""
  cfg = config_lib.ModelConfig(d_model=32, num_heads=2, attention_impl="xla")
  rng = np.random.default_rng(1)
  specs = blocks.layer_param_specs(cfg)
  p = {
    name: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32) * 0.3)
    for name, s in specs.items()
    if name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
  }
  x = jnp.asarray(rng.standard_normal((2, 40, 32)).astype(np.float32))
  seg = np.repeat([[1] * 25 + [2] * 15], 2, 0).astype(np.int32)
  positions = jnp.asarray(np.repeat([list(range(25)) + list(range(15))], 2, 0))
  q, k, v = blocks.qkv_projections(x, p, cfg, positions)
  want = np.einsum(
    "btnh,nhd->btd", reference_attention(q, k, v, seg), np.asarray(p["wo"], np.float64)
  ) + np.asarray(p["bo"])
  for impl in ("xla", "auto"):
    c = dataclasses.replace(cfg, attention_impl=impl)
    got = blocks.attention(x, p, c, blocks.attention_mask(jnp.asarray(seg)), positions)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=impl)


@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("packed", [True, False])
def test_splash_kernel_interpreted_equals_the_reference(packed):
  """The splash kernel program (Pallas' interpreter: any platform) on packed rows."""
  q, k, v, seg = _inputs()
  seg = seg if packed else None
  mask = blocks.attention_mask(None if seg is None else jnp.asarray(seg))
  out = jax.jit(
    lambda q, k, v: blocks.dot_product_attention(q, k, v, mask, "splash", interpret=True)
  )(q, k, v)
  np.testing.assert_allclose(
    np.asarray(out), reference_attention(q, k, v, seg), rtol=1e-5, atol=1e-5
  )


@pytest.mark.matmul_precision("highest")
def test_splash_gradients_under_a_mesh_equal_xla_gradients():
  """Splash per shard (shard_map over the mesh's batch and head axes), differentiated:
  its q, k, v gradients equal the XLA kernel's (checked against the reference above)."""
  q, k, v, seg = _inputs()
  mesh = sharding.make_mesh(default.get_config().mesh, jax.devices()[:1])
  rules = sharding.activation_rules(sharding.logical_axis_rules())
  w = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)

  def grads(kernel):
    def loss(q, k, v):
      mask = blocks.attention_mask(jnp.asarray(seg))
      out = blocks.dot_product_attention(q, k, v, mask, kernel, interpret=True)
      return jnp.sum(out * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    got = grads("splash")
  for g, want in zip(got, grads("xla")):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------
# The platform's own kernels (skip elsewhere)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
  "kernel,dtype,tolerance",
  [
    pytest.param(
      "cudnn",
      jnp.bfloat16,
      2e-2,
      marks=pytest.mark.skipif(
        PLATFORM != "cuda",
        reason="cuDNN attention needs an NVIDIA GPU (run with JAX_PLATFORMS=cuda on one)",
      ),
    ),
    pytest.param(
      "splash",
      jnp.float32,
      2e-3,
      marks=pytest.mark.skipif(
        PLATFORM != "tpu",
        reason="the compiled splash kernel needs a TPU (run with "
        "JAX_PLATFORMS=tpu on one; elsewhere it is interpreted above)",
      ),
    ),
  ],
)
def test_platform_kernel_compiled_equals_the_reference(kernel, dtype, tolerance, packed):
  q, k, v, seg = _inputs(h=128)
  seg = seg if packed else None
  mask = blocks.attention_mask(None if seg is None else jnp.asarray(seg))
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  out = jax.jit(lambda q, k, v: blocks.dot_product_attention(q, k, v, mask, kernel))(q, k, v)
  want = reference_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), seg)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=tolerance, atol=tolerance)


# --------------------------------------------------------------------------------------
# Which kernel
# --------------------------------------------------------------------------------------
def _cfg(**kw):
  return config_lib.ModelConfig(d_model=128, num_heads=2, **kw)


@pytest.mark.parametrize(
  "platform,dtype,seq_len,kernel",
  [
    ("cpu", "bfloat16", 256, "xla"),
    ("cuda", "bfloat16", 256, "cudnn"),
    ("cuda", "float32", 256, "xla"),  # cuDNN's flash attention takes 16-bit floats
    ("rocm", "bfloat16", 256, "xla"),
    ("tpu", "float32", 256, "splash"),
    ("tpu", "float32", 200, "xla"),  # not whole 128-token tiles
  ],
)
def test_auto_picks_the_platform_kernel(platform, dtype, seq_len, kernel):
  assert blocks.attention_kernel(_cfg(dtype=dtype), seq_len, platform) == kernel


@pytest.mark.parametrize(
  "impl,platform,dtype,seq_len,words",
  [
    ("splash", "cpu", "float32", 256, "runs on TPUs only, this run is on cpu"),
    ("splash", "tpu", "float32", 200, "multiple of 128, got 200"),
    ("cudnn", "tpu", "bfloat16", 256, "runs on NVIDIA GPUs only, this run is on tpu"),
    ("cudnn", "cuda", "float32", 256, "bfloat16"),
  ],
)
def test_a_kernel_the_platform_cannot_run_is_a_one_line_config_error(
  impl, platform, dtype, seq_len, words
):
  with pytest.raises(ConfigError, match=words) as e:
    blocks.attention_kernel(_cfg(attention_impl=impl, dtype=dtype), seq_len, platform)
  assert "\n" not in str(e.value) and "'auto' or 'xla'" in str(e.value)


def test_explicit_kernels_that_run_are_kept():
  assert blocks.attention_kernel(_cfg(attention_impl="xla"), 100, "tpu") == "xla"
  assert blocks.attention_kernel(_cfg(attention_impl="splash"), 256, "tpu") == "splash"
  assert (
    blocks.attention_kernel(_cfg(attention_impl="cudnn", dtype="bfloat16"), 100, "cuda") == "cudnn"
  )


def test_unknown_attention_impl_is_a_config_error():
  c = default.get_config()
  assert c.model.attention_impl == "auto"
  c.model.attention_impl = "flash"
  with pytest.raises(ConfigError, match=r"model.attention_impl='flash' is unknown"):
    config_lib.model_config(c)


_SPLASH_ON_A_MESH = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from configs import default
from odetransformer.model import blocks
from odetransformer.train import sharding
from test_attention import _inputs

c = default.get_config()
c.mesh.shape = (2, 2, 2)
mesh = sharding.make_mesh(c.mesh)
rules = sharding.activation_rules(sharding.logical_axis_rules(c.mesh))
q, k, v, seg = _inputs(b=4)
seg[2, 40:] = 7
w = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
spec = sharding.logical_to_spec(("batch", None, "heads", None), rules)
put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

def run(kernel):
  def loss(q, k, v):
    out = blocks.dot_product_attention(q, k, v, blocks.attention_mask(jnp.asarray(seg)),
                                       kernel, interpret=True)
    return jnp.sum(out * w), out
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        put(q), put(k), put(v))
  return [np.asarray(x).tolist() for x in (out,) + grads], str(out.sharding.spec)

splash, splash_spec = run("splash")
xla, _ = run("xla")
print(json.dumps({"splash": splash, "xla": xla, "spec": splash_spec}))
"""


@pytest.mark.slow
def test_splash_sharded_over_batch_and_heads_equals_xla(tmp_path):
  """Splash per shard on a (2, 2, 2) mesh of 8 host devices (batch over data × fsdp,
  heads over tensor), interpreted: output and q, k, v gradients equal XLA's there."""
  out, _ = run_on_8_cpu_devices(_SPLASH_ON_A_MESH, tmp_path, timeout=300)
  assert "tensor" in out["spec"] and "fsdp" in out["spec"], out["spec"]
  for got, want in zip(out["splash"], out["xla"]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
