"""MLA tree-verify attention: ``api.latent_attention(impl=)`` over ``reference``, ``xla`` and ``pallas_triton``."""
