# jaxlib's compiled extension ships no stubs, so mypy reads
# jax.tree_util.PyTreeDef (an alias of this module's) as an unknown name. This
# partial stub gives it the methods optax_adama calls; every other name of the
# extension stays Any.
from collections.abc import Iterable
from typing import Any

class PyTreeDef:
  num_leaves: int
  num_nodes: int
  def unflatten(self, leaves: Iterable[Any], /) -> Any: ...
  def flatten_up_to(self, tree: Any, /) -> list[Any]: ...
  def children(self) -> list[PyTreeDef]: ...

def __getattr__(name: str) -> Any: ...
