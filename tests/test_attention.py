"""Attention kernels (`model.attention_impl`): each against a float64 numpy reference,
packed documents (segment ids) included; the kernel choice per platform and its errors.

XLA runs everywhere. Splash is a Pallas TPU kernel: on CPU it runs in Pallas'
interpreter (the same kernel program, interpreted); compiled only on a TPU. cuDNN
needs an NVIDIA GPU. The tests of a platform's own kernel skip elsewhere, saying why;
the suite runs on CPU (conftest), so run them with JAX_PLATFORMS=cuda or tpu there.
"""

import dataclasses
import functools
import importlib.util
import itertools
import json
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from odetransformer.errors import ConfigError
from odetransformer.model import blocks
from odetransformer.model import config as config_lib
from odetransformer.tools import compile_targets
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


@pytest.mark.matmul_precision("highest")
@pytest.mark.skipif(
  PLATFORM != "cuda",
  reason="cuDNN attention needs an NVIDIA GPU (run with JAX_PLATFORMS=cuda on one)",
)
@pytest.mark.parametrize("documents", ["within the bound", "over the bound"])
def test_cudnn_packed_layout_equals_xla_with_gradients(documents):
  """cuDNN in its packed layout against the XLA kernel on the same bfloat16 inputs (in
  float32): output and q, k, v gradients, on rows of three documents, one, two then id-0
  padding, and id-0 padding then a token per document, then one: within
  PACKED_MAX_SEGMENTS documents a row (the packed layout runs), and over it (the batch
  takes the dense mask)."""
  if blocks._compute_capability() < (9, 0):
    pytest.skip("cuDNN's packed layout needs Hopper or newer (older GPUs get the dense mask)")
  q, k, v, seg = _inputs(b=4, h=64)
  seg[2, 50:] = 2
  seg[2, 100:] = 0
  m = blocks.PACKED_MAX_SEGMENTS
  singles = m - 2 if documents == "within the bound" else m + 20
  seg[3, :5] = 0
  seg[3, 5 : 5 + singles] = np.arange(1, singles + 1)
  seg[3, 5 + singles :] = singles + 1
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
  mask = blocks.attention_mask(jnp.asarray(seg))

  def out_and_grads(kernel, q, k, v):
    def loss(q, k, v):
      out = blocks.dot_product_attention(q, k, v, mask, kernel)
      return jnp.sum(out.astype(jnp.float32) * w), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, *grads)

  cudnn = jax.jit(functools.partial(out_and_grads, "cudnn")).lower(q, k, v).compile()
  calls = _fmha_calls(cudnn.as_text())
  assert {c["max_seg_per_batch"] for _, _, c in calls} == {1, m}, calls  # packed + dense
  got = cudnn(q, k, v)
  want = jax.jit(functools.partial(out_and_grads, "xla"))(
    *(x.astype(jnp.float32) for x in (q, k, v))
  )
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(b).max()), err_msg=name)


# --------------------------------------------------------------------------------------
# cuDNN's packed layout (segment lengths and offsets)
# --------------------------------------------------------------------------------------
def reference_packed_segments(segment_ids, max_segments):
  """(seqlen [b, M], offsets [b, M+1]) of each row's runs of equal ids, -1 past them."""
  seg = np.asarray(segment_ids)
  seqlen = np.full((seg.shape[0], max_segments), -1, np.int32)
  offsets = np.full((seg.shape[0], max_segments + 1), -1, np.int32)
  for row, ids in enumerate(seg):
    lengths = [len(list(run)) for _, run in itertools.groupby(ids.tolist())]
    seqlen[row, : len(lengths)] = lengths
    offsets[row, : len(lengths)] = np.cumsum([0] + lengths[:-1])
  return seqlen, offsets


_LAYOUTS = {
  "one document": [1] * 8,
  "three documents": [1, 1, 1, 2, 2, 3, 3, 3],
  "a token per document": [1, 2, 3, 4, 5, 6, 7, 8],
  "padding at both ends": [0, 0, 1, 1, 1, 2, 0, 0],
  "padding after": [1, 1, 2, 2, 2, 0, 0, 0],
}


def _random_rows(b=6, length=64, seed=0):
  """Packed rows of random document lengths, some with id-0 padding at either end."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(b):
    lengths = rng.integers(1, 12, size=length)
    ids = np.repeat(np.arange(1, length + 1), lengths)[:length]
    if rng.random() < 0.5:
      ids[: rng.integers(1, 5)] = 0
    if rng.random() < 0.5:
      ids[length - rng.integers(1, 5) :] = 0
    rows.append(ids)
  return np.stack(rows).astype(np.int32)


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_packed_segments_equal_the_reference(layout):
  seg = np.asarray([_LAYOUTS[layout], _LAYOUTS["three documents"]], np.int32)
  fewest = max(len(list(itertools.groupby(ids))) for ids in seg.tolist())
  for max_segments in sorted({fewest, 8, 12}):  # the bound taken exactly, l, above l
    got = jax.jit(blocks.packed_segments, static_argnums=1)(jnp.asarray(seg), max_segments)
    for g, want in zip(got, reference_packed_segments(seg, max_segments)):
      assert g.dtype == jnp.int32
      np.testing.assert_array_equal(np.asarray(g), want, err_msg=f"{layout}, M={max_segments}")


def test_packed_segments_of_random_rows_equal_the_reference():
  """Also under a bound M below some rows' segment count: those rows keep their first M
  segments, and the others (and the offsets' last entry, always -1) are untouched."""
  seg = _random_rows()
  got = blocks.packed_segments(jnp.asarray(seg), seg.shape[1])
  for g, want in zip(got, reference_packed_segments(seg, seg.shape[1])):
    np.testing.assert_array_equal(np.asarray(g), want)
  seqlen, offsets = blocks.packed_segments(jnp.asarray(seg), 5)
  want_seqlen, want_offsets = reference_packed_segments(seg, seg.shape[1])
  np.testing.assert_array_equal(np.asarray(seqlen), want_seqlen[:, :5])
  np.testing.assert_array_equal(np.asarray(offsets)[:, :5], want_offsets[:, :5])
  assert (np.asarray(offsets)[:, 5] == -1).all() and (want_seqlen[:, 5] > 0).any()


def test_packed_segments_mean_what_the_dense_mask_means():
  """Every token in exactly one segment, and two tokens in the same one exactly where
  `SegmentMask.dense` lets them attend (the kernel's causality aside), except padding
  at both ends of a row: two segments, where the dense mask joins them (id 0 both)."""
  seg = np.concatenate([_random_rows(length=8, seed=1), np.asarray(list(_LAYOUTS.values()))])
  seqlen, offsets = (np.asarray(x) for x in blocks.packed_segments(jnp.asarray(seg), 8))
  label = np.full(seg.shape, -1)
  for row in range(seg.shape[0]):
    count = int((seqlen[row] >= 0).sum())
    assert (seqlen[row, count:] == -1).all() and (offsets[row, count:] == -1).all()
    for s in range(count):
      start, n = offsets[row, s], seqlen[row, s]
      assert n > 0 and (label[row, start : start + n] == -1).all()
      label[row, start : start + n] = s
  assert (label >= 0).all()
  same = label[:, :, None] == label[:, None, :]
  dense = np.asarray(blocks.SegmentMask(jnp.asarray(seg)).dense())[:, 0]
  padding_apart = (seg[:, :, None] == 0) & (seg[:, None, :] == 0) & ~same
  assert padding_apart.any()  # a row padded at both ends is among them
  np.testing.assert_array_equal(same, dense & ~padding_apart)


def _fmha_calls(hlo_text):
  """(target, operand shapes, cudnn_fmha_backend_config) of each cuDNN attention call in
  compiled HLO text."""
  calls = []
  for line in hlo_text.splitlines():
    target = re.search(r'custom_call_target="(__cudnn\$fmha\w*)"', line)
    if target is None:
      continue
    operands = re.search(r"custom-call\((.*?)\), custom_call_target", line).group(1)
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line).group(1)
    shapes = re.findall(r"(\w+\[[\d,]*\])\{", layouts)
    assert len(shapes) == operands.count("%"), line
    config = json.loads(line.split("backend_config=", 1)[1])["cudnn_fmha_backend_config"]
    calls.append((target.group(1), shapes, config))
  return calls


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("jax_cuda12_plugin") is None,
  reason="compiling for an NVIDIA GPU on this host needs jax's CUDA plugin "
  "(jax-cuda12-plugin), which is not installed",
)
def test_cudnn_packed_layout_compiles_for_an_h100_without_a_mask_operand(monkeypatch):
  """Packed rows' cuDNN calls compiled for an H100 on this CPU: forward and backward take
  segment lengths [b, M] and offsets [b, M+1] (max_seg_per_batch = M =
  PACKED_MAX_SEGMENTS), no bias or mask operand, beside the dense fallback for a batch
  with a fuller row; with the batch split over two GPUs, each its own rows' (segment ids
  given replicated). Before Hopper the kernel takes the dense mask as a bias operand
  [b, 1, l, l] (what every GPU got before the packed layout).

  jax's check for the packed layout reads the compute capability of its default backend
  (this host's CPU), not of the GPU compiled for: here it answers for the H100 (9.0)."""
  from jax._src import config as jax_config
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  from jax.experimental import topologies

  assert jax.default_backend() == "cpu"  # conftest: the suite runs on CPU
  h100 = compile_targets.H100_TARGET
  b, length, n, h = 2, 128, 2, 64

  def compiled(fn, topology):
    """The cuDNN attention calls of fn(q, k, v, segment_ids), compiled for H100s."""
    devices = topologies.get_topology_desc(
      platform="cuda", topology=topology, target_config=h100.read_text()
    ).devices
    capability = tuple(int(x) for x in devices[0].compute_capability.split("."))
    monkeypatch.setattr(
      cudnn_attention,
      "check_compute_capability",
      lambda c: capability >= tuple(int(x) for x in c.split(".")),
    )
    mesh = sharding.make_mesh(default.get_config().mesh, devices)
    rules = sharding.activation_rules(sharding.logical_axis_rules())
    spec = sharding.logical_to_spec(("batch", None, "heads", None), rules)
    put = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    qkv = jax.ShapeDtypeStruct((b, length, n, h), jnp.bfloat16, sharding=put(spec))
    seg = jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=put(jax.sharding.PartitionSpec()))
    # Never written to the compilation cache: a compile-only executable cannot be loaded
    # back (jax warns on reading it).
    with (
      jax.set_mesh(mesh),
      nnx.logical_axis_rules(rules),
      jax_config.persistent_cache_min_compile_time_secs(1e9),
    ):
      assert blocks._platform() == "cuda"
      fresh = lambda *args: fn(*args)  # noqa: E731  (traced anew: not jit's cached trace)
      return _fmha_calls(jax.jit(fresh).lower(qkv, qkv, qkv, seg).compile().as_text())

  def forward(q, k, v, seg):
    return blocks.dot_product_attention(q, k, v, blocks.attention_mask(seg), "cudnn")

  def gradients(q, k, v, seg):
    loss = lambda *qkv: jnp.sum(forward(*qkv, seg).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  qkv = f"bf16[{b},{length},{n},{h}]"
  m = blocks.PACKED_MAX_SEGMENTS
  rows, offsets = f"s32[{b},{m}]", f"s32[{b},{m + 1}]"
  stats = f"f32[{b * m},{n},{length}]"  # softmax statistics [b * M, n, l]
  bias = f"bf16[{b},1,{length},{length}]"
  calls = compiled(forward, "1x1x1") + compiled(gradients, "1x1x1")
  targets = sorted(target for target, _, _ in calls)
  # Each call is a conditional: the packed layout when every row holds at most M
  # documents, the dense mask (a bias operand) otherwise.
  packed = ["__cudnn$fmhaSoftmax"] * 2 + ["__cudnn$fmhaSoftmaxBackward"]
  dense = ["__cudnn$fmhaScaleBiasSoftmax"] * 2 + ["__cudnn$fmhaScaleBiasSoftmaxBackward"]
  assert targets == sorted(packed + dense), targets
  for target, shapes, config in calls:
    assert config["mask_type"] == "CAUSAL", config
    assert config["fmha_scale"] == pytest.approx(1 / np.sqrt(h))
    if target == "__cudnn$fmhaSoftmax":  # q, k, v, seqlen (q, kv), offsets (q, kv)
      assert config["max_seg_per_batch"] == m, config
      assert shapes == [qkv] * 3 + [rows] * 2 + [offsets] * 2, shapes
    elif target == "__cudnn$fmhaSoftmaxBackward":  # + statistics, dO, O
      assert config["max_seg_per_batch"] == m, config
      assert shapes == [qkv] * 3 + [stats, qkv, qkv] + [rows] * 2 + [offsets] * 2, shapes
    else:
      assert config["max_seg_per_batch"] == 1 and bias in shapes, (config, shapes)

  (shapes,) = [s for t, s, _ in compiled(forward, "1x2x1") if t == "__cudnn$fmhaSoftmax"]
  assert shapes[3:] == [f"s32[1,{m}]"] * 2 + [f"s32[1,{m + 1}]"] * 2, shapes  # a row a GPU

  monkeypatch.setattr(blocks, "_compute_capability", lambda: (8, 0))  # an A100
  ((target, shapes, config),) = compiled(forward, "1x1x1")
  assert target == "__cudnn$fmhaScaleBiasSoftmax" and config["max_seg_per_batch"] == 1, target
  assert shapes == [qkv] * 3 + [f"bf16[{b},1,{length},{length}]"], shapes


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
rules = sharding.activation_rules(sharding.logical_axis_rules(c.mesh.rules))
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
