import jax, jax.numpy as jnp, numpy as np, sys
sys.path.insert(0, 'tests'); sys.path.insert(0, 'tests/kernels')
from test_hsa_select import make_inputs
from rocketkv_jax.kernels.hsa_scores import hsa_page_partials, row_channels, choice_dot_dtype
from rocketkv_jax.kernels.page_topk import hsa_page_topk
from rocketkv_jax.kernels.hsa_select import hsa_select_gather
for (seed,B,K,G,H,S,ps,k,topr,qd,kd,sink,recent) in [(0,3,2,4,64,100,3,24,20,jnp.float32,jnp.float32,0,0),
    (1,4,1,2,128,200,2,40,67,jnp.bfloat16,jnp.bfloat16,0,0),(2,2,2,8,64,97,1,17,40,jnp.bfloat16,jnp.float8_e5m2,0,0),
    (3,5,2,4,64,160,3,30,33,jnp.bfloat16,jnp.bfloat16,3,4)]:
  q, kmin, kmax, length = make_inputs(seed,B,K,G,H,S,ps,qd,kd,aligned=True)
  choice = row_channels(q, topr, choice_dot_dtype(q.dtype, kmin.dtype), interpret=False)
  s,m,l = hsa_page_partials(q,kmin,kmax,length,topr=topr,page_size=ps,interpret=False,choice=choice,split_pages=False)
  a = hsa_page_topk(s,m,l,length,page_size=ps,k=k,num_slots=S,sink=sink,recent=recent,interpret=False)
  b = hsa_select_gather(q,kmin,kmax,length,choice,topr=topr,page_size=ps,k=k,num_slots=S,sink=sink,recent=recent,interpret=False)
  print(seed, np.array_equal(np.asarray(a), np.asarray(b)), a.shape)
# decode-like shapes: 32k t=256 (1617 slots, pages of 3, top_r 60, k 128) at 391 x 8 rows; 64k (top_r 65)
from rocketkv_jax.kernels.checks import kt_num_pages
for (B, S, ps, k, topr) in [(391, 1617, 3, 128, 60), (300, 3000, 4, 128, 65), (64, 1617, 3, 128, 60)]:
  q, kmin, kmax, length = make_inputs(7, B, 8, 4, 128, S, ps, jnp.bfloat16, jnp.bfloat16, aligned=True)
  choice = row_channels(q, topr, jnp.bfloat16)
  s,m,l = hsa_page_partials(q,kmin,kmax,length,topr=topr,page_size=ps,choice=choice,split_pages=False)
  a = hsa_page_topk(s,m,l,length,page_size=ps,k=k,num_slots=S)
  b = hsa_select_gather(q,kmin,kmax,length,choice,topr=topr,page_size=ps,k=k,num_slots=S)
  print("big", B, S, np.array_equal(np.asarray(a), np.asarray(b)))
