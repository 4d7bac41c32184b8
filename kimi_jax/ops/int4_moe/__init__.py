"""The INT4 routed-expert matmul: ``api.int4_moe(impl=)`` over ``xla``, ``pallas_triton`` and ``reference``."""
