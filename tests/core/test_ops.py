"""The dispatch table: every op's XLA path (its kernel module's reference, or a named faster variant) against
the reference, and against the kernel body in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax import ops
from rocketkv_jax.models import layer_ops
from rocketkv_jax.kernels.cache_append import cache_append_reference
from rocketkv_jax.kernels.page_topk import page_topk_reference
from tests.helpers.data import keys, normal


def test_every_op_has_both_paths():
  for name, op in {**ops.OPS, **layer_ops.OPS}.items():
    assert callable(op.xla) and callable(op.kernel), name
  # The model's own ops (RMSNorm, RoPE) live in the model's table, not the KV core's (issue 38).
  assert not set(ops.OPS) & set(layer_ops.OPS)
  assert ops.resolve_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
  with pytest.raises(ValueError, match="impl='cuda'"):
    ops.resolve_impl("cuda")


@pytest.mark.parametrize("num_slots,page_size", [(203, 4), (64, 1), (1000, 7)])
def test_page_topk_best_pages_equals_reference(num_slots, page_size):
  """The best-pages variant (long caches) returns the reference's array exactly, ties included, and so does the
  kernel in interpret mode."""
  rng = np.random.default_rng(num_slots)
  b, n_kv = 3, 2
  num_pages = -(-num_slots // page_size)
  scores = jnp.asarray(rng.integers(0, 5, (b, n_kv, num_pages)).astype(np.float32))  # many ties
  length = jnp.array([num_slots, 57, 1])
  for k in (1, 7, 64, 300):
    args = dict(page_size=page_size, k=k, num_slots=num_slots)
    want = np.asarray(page_topk_reference(scores, length, **args))
    np.testing.assert_array_equal(np.asarray(ops.page_topk_best_pages(scores, length, **args)), want, err_msg=k)
    np.testing.assert_array_equal(np.asarray(ops.page_topk(scores, length, impl="interpret", **args)), want,
                                  err_msg=k)
    assert [int((want[i, 0] != 0).sum() + (want[i, 0, 0] == 0)) for i in range(b)] == \
        [min(k, n) for n in (num_slots, 57, 1)]


@pytest.mark.parametrize("slot_rank", [1, 2])
@pytest.mark.parametrize("with_pages", [False, True])
def test_cache_append_scatter_equals_reference(slot_rank, with_pages):
  """The scatter variant writes what the reference's select writes (the KT fold), for slots in range, past the end and
  negative, one slot per sequence or one per KV head; fresh and partly filled pages."""
  B, K, S, H, page_size = 4, 2, 23, 16, 3
  ks = keys(0, 6)
  k, v = (normal(x, (B, K, S, H)) for x in ks[:2])
  pages = tuple(normal(x, (B, K, H, -(-S // page_size))) for x in ks[2:4]) if with_pages else ()
  k_new, v_new = (normal(x, (B, K, H)) for x in ks[4:])
  slot = jnp.array([0, 7, S, -1], jnp.int32)
  if slot_rank == 2:
    slot = jnp.stack([slot, jnp.array([22, 5, -3, S + 4], jnp.int32)], axis=1)
  got = ops.cache_append_scatter(k, v, k_new, v_new, slot, *pages, page_size=page_size)
  want = cache_append_reference(k, v, k_new, v_new, slot, *pages, page_size=page_size, kt_update="fold")
  assert len(got) == len(want) == 2 + len(pages)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
