"""Pallas GPU (Triton backend) kernels for RocketKV decode: dense and sparse decode attention, HSA page
scoring and top-k, the token append, and the model's fused add + RMSNorm and q/k/v RoPE. Each op module
holds a plain-jnp reference, the kernel body and a public wrapper; `attention_reference`, `checks`,
`splitk`, `topk_select` and `triton_util` hold what they share. Interpret mode runs the same kernel bodies
as the compiled code. These modules never import the rocketkv_jax core."""
