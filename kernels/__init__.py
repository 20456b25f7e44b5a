"""Pallas GPU (Triton backend) kernels for RocketKV decode: dense and sparse decode attention and
HSA page scoring. Each module holds a plain-jnp reference, the kernel body and a public wrapper.
These modules never import the rocketkv_jax core."""
