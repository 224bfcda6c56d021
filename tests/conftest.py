"""Strict JAX settings for every test, in the style of Equinox's test suite.

Rank promotion and implicit dtype promotion raise, so library code must say
what it means. Reference optimizers from optax are run under
``jax.numpy_dtype_promotion("standard")`` where they need it (optax's own bias
correction computes ``float ** int32``).
"""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

