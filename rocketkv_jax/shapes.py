"""The one shape legend of the project (STYLE.md). Locals carry these letters as suffixes.

B batch, T new tokens (prompt), S cache slots, N query heads, K KV heads, G query heads per KV head,
H head dim, D model dim, F MLP hidden, V vocab, W observation window, P pages, R kept channels,
M selected tokens, L layers.
"""
