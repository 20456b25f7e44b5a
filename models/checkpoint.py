"""What the checkpoint formats share: CheckpointError, and the per-layer tensor table both readers check a
file against (`gguf.read_gguf`, `safetensors_hf.stream_hf_dir`)."""

from __future__ import annotations

from .llama import LlamaConfig


class CheckpointError(ValueError):
  """A checkpoint is missing, malformed or truncated; the message says what and where."""


def layer_tensors(cfg: LlamaConfig) -> dict:
  """Each layer's tensors, one table for every format: loader name -> (GGUF name, HF name within a layer,
  shape in the file: [out, in]); with the q/k/v biases when the model has them (Qwen2)."""
  D, N, K, H, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
  tensors = {
      "attn_norm": ("attn_norm.weight", "input_layernorm.weight", (D,)),
      "wq": ("attn_q.weight", "self_attn.q_proj.weight", (N * H, D)),
      "wk": ("attn_k.weight", "self_attn.k_proj.weight", (K * H, D)),
      "wv": ("attn_v.weight", "self_attn.v_proj.weight", (K * H, D)),
      "wo": ("attn_output.weight", "self_attn.o_proj.weight", (D, N * H)),
      "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight", (D,)),
      "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight", (F, D)),
      "w_up": ("ffn_up.weight", "mlp.up_proj.weight", (F, D)),
      "w_down": ("ffn_down.weight", "mlp.down_proj.weight", (D, F)),
  }
  if cfg.qkv_bias:
    tensors.update(bq=("attn_q.bias", "self_attn.q_proj.bias", (N * H,)),
                   bk=("attn_k.bias", "self_attn.k_proj.bias", (K * H,)),
                   bv=("attn_v.bias", "self_attn.v_proj.bias", (K * H,)))
  return tensors
