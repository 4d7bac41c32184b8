"""MLA's latent projection (the attention norm, q_a and kv_a, their norms, the key's RoPE) as one op: ``api``."""
