# jaxlib's compiled extension ships no stubs; see pytree.pyi.
from typing import Any

from jaxlib._jax import pytree as pytree

def __getattr__(name: str) -> Any: ...
