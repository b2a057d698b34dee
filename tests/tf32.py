"""A GPU's TF32 float32 matmuls, on the CPU: for finding, without a GPU, the tests whose
float32 comparisons depend on the matmul precision (they then ask for it with
`@pytest.mark.matmul_precision("highest")`).

On NVIDIA GPUs XLA runs a float32 dot at the default precision as TF32: each operand
rounded to 10 mantissa bits, products accumulated in float32. XLA:CPU computes it in full
float32. `ODET_TEST_EMULATE_TF32=1 python -m pytest ...` makes the CPU round the operands
of every such dot the same way (lax.reduce_precision's HLO before the dot); a dot at
'high' or 'highest', or of other dtypes, is left as it is. It replaces a private lowering
rule of jax (jax._src.lax.lax), so it is a test aid, not part of the library.
"""

import functools

import numpy as np

EMULATE_ENV = "ODET_TEST_EMULATE_TF32"


def emulate_tf32_on_cpu() -> None:
  """Registers the CPU lowering of lax.dot_general that rounds float32 operands of
  default-precision dots to TF32. Call before anything is compiled."""
  # lazy: jax only when emulating; conftest imports this module before the XLA flags are set
  from jax._src.interpreters import mlir
  from jax._src.lax import lax as lax_internal
  from jax._src.lib.mlir.dialects import hlo

  cpu_rule = functools.partial(lax_internal._dot_general_lower, platform="cpu")
  default = (lax_internal.Precision.DEFAULT, lax_internal.Precision.DEFAULT)

  def to_tf32(x, aval):
    if aval.dtype != np.float32:
      return x
    return hlo.reduce_precision(x, mlir.i32_attr(8), mlir.i32_attr(10))

  def rule(ctx, lhs, rhs, *, precision, **params):
    if precision is None or precision == default:
      lhs, rhs = (to_tf32(x, aval) for x, aval in zip((lhs, rhs), ctx.avals_in))
    return cpu_rule(ctx, lhs, rhs, precision=precision, **params)

  mlir.register_lowering(lax_internal.dot_general_p, rule, platform="cpu")
