"""Argument checks of AdamA's factories and of the steps that read them.

Each raises as soon as a bad value can be seen, naming the argument (or the
param leaf) and what to pass instead.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any
from typing import Optional
from typing import TypeVar
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama._quantize import BlockQuantization


def check_num_micro_batches(num_micro_batches: Any) -> int:
  """``N`` as a Python int.

  Integer-like values are accepted as :class:`optax.MultiSteps` accepts them
  (``np.int64(2)``, a 0-d NumPy integer array); bools and floats are not, and
  neither is a JAX array: ``N`` fixes the structure of the state (it is a
  static field of :class:`ScaleByAdamAState`), so it must be known without
  tracing. A JAX array ``N`` is what ``optax.inject_hyperparams`` passes when
  ``num_micro_batches`` is not among its ``static_args``; that wrapper would
  also evaluate a plain schedule once per ``update`` call, i.e. per
  micro-batch, so the error names both ways that count mini-batches.
  """
  value = num_micro_batches
  if (isinstance(value, jax.Array) and jnp.ndim(value) == 0
      and jnp.issubdtype(value.dtype, jnp.integer)):
    raise ValueError(
        f"num_micro_batches must be a Python or NumPy integer, got a JAX array "
        f"({value!r}): N fixes the state's structure. optax.inject_hyperparams "
        "turns numeric arguments into arrays (and would evaluate a schedule once "
        "per update call, i.e. per micro-batch). Use "
        "optax_adama.inject_hyperparams(...) (N static, schedules count "
        "mini-batches), or optax.inject_hyperparams(..., "
        "static_args=(\"num_micro_batches\",)) for constant hyperparameters.")
  dtype = getattr(value, "dtype", None)
  is_integer_array = (
      dtype is not None and np.issubdtype(dtype, np.integer) and np.ndim(value) == 0)
  if isinstance(value, bool) or not (isinstance(value, int) or is_integer_array):
    raise TypeError(
        f"num_micro_batches must be an integer, got {value!r} "
        f"({type(value).__name__}).")
  value = int(value)
  if value < 1:
    raise ValueError(f"num_micro_batches must be >= 1, got {value}.")
  return value


def check_hyperparams(b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
  """Rejects decay rates outside [0, 1) and negative epsilons, quoting them.

  ``b2 = 1`` would make v's bias correction ``1 - b2**t`` zero. Traced values
  (``optax.inject_hyperparams`` inside ``jit``) cannot be checked and pass.
  """
  ranges = {"b1": (b1, 0.0, 1.0), "b2": (b2, 0.0, 1.0),
            "eps": (eps, 0.0, math.inf), "eps_root": (eps_root, 0.0, math.inf)}
  for name, (value, low, high) in ranges.items():
    if isinstance(value, jax.core.Tracer) or jnp.ndim(value) != 0:
      continue
    if not low <= float(value) < high:
      bound = f"in [{low}, {high})" if high < math.inf else f">= {low}"
      rounded = ""
      if float(value) == high and jnp.dtype(dtype_of(value)).itemsize < 4:
        rounded = (f": a decay rate below 1 rounds to 1 in {dtype_of(value)}, as "
                   "inject_hyperparams casts hyperparameters to the params' dtype; "
                   "pass inject_hyperparams(..., hyperparam_dtype=jnp.float32)")
      raise ValueError(f"{name} must be {bound}, got {value!r}{rounded}.")


def real_hyperparam(value: Any) -> Any:
  """``value``'s real part where it is complex, else ``value``.

  ``optax.inject_hyperparams`` casts hyperparameters to the params' widest
  dtype, complex64 for complex params; rates and decays are real, and a
  complex one would turn the updates of real leaves complex.
  """
  if callable(value) or not jnp.iscomplexobj(value):
    return value
  return jnp.real(value)


def check_nesterov(nesterov: Any) -> None:
  # optax's Nesterov direction, b1 m_hat + (1 - b1) g_bar / (1 - b1**t), reads
  # the step's mean gradient g_bar beside m: the buffer AdamA never forms.
  if nesterov:
    raise ValueError(
        f"nesterov={nesterov!r}: AdamA has no Nesterov form. optax's reads the "
        "mini-batch's mean gradient beside m, the gradient buffer AdamA exists to "
        "drop; use optax.MultiSteps(optax.adam(..., nesterov=True)) for it.")


def check_storage_options(quantization: Any, stochastic_rounding: Any) -> None:
  """Raises for a bad ``quantization`` / ``stochastic_rounding``."""
  if quantization is not None and not isinstance(quantization, BlockQuantization):
    raise TypeError(
        f"quantization must be a BlockQuantization or None, got {quantization!r}.")
  if not isinstance(stochastic_rounding, (bool, np.bool_)):
    raise TypeError(
        f"stochastic_rounding must be a bool, got {stochastic_rounding!r}.")


def check_float_params(params: optax.Params,
                       quantization: Optional[BlockQuantization]) -> None:
  """Raises a ``TypeError`` naming every leaf AdamA cannot move.

  Real and complex floats move as in ``optax.adam`` (complex leaves fold
  ``|g|**2`` into v); integer and boolean leaves never would, and complex
  leaves have no 8-bit codes.
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  name = lambda path, leaf: f"{jax.tree_util.keystr(path)} ({dtype_of(leaf)})"
  bad = [name(path, leaf) for path, leaf in leaves
         if not jnp.issubdtype(dtype_of(leaf), jnp.inexact)]
  if bad:
    # nnx.split(model) with no filter hands over every Variable: a Dropout's
    # RngKey (key<fry>) and RngCount (uint32), a cache index. optax.adam's init
    # accepts them and its update then breaks on them; name them up front.
    raise TypeError(
        "AdamA moves floating-point params only; these leaves would "
        f"never move: {', '.join(bad)}. Keep integer, boolean and PRNG-key "
        "state out of the optimized tree: split the params apart "
        "(graphdef, params, rest = nnx.split(model, nnx.Param, ...)) or "
        "nnx.Optimizer(model, tx, wrt=nnx.Param); or cast them to a float "
        "dtype.")
  quantized = complex_leaf_names(params, [
      quantization is not None and quantization.quantizes(jnp.shape(leaf))
      for _, leaf in leaves])
  if quantized:
    raise TypeError(
        f"8-bit moments are real; these complex leaves cannot take them: "
        f"{', '.join(quantized)}. Raise BlockQuantization(min_size=...) above "
        "their size or pass quantization=None.")


def complex_leaf_names(params: optax.Params, selected: Any = None) -> list[str]:
  """``"['path'] (dtype)"`` of each complex leaf (of those ``selected``, a
  list aligned with the leaves, is true for), for errors that name them."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  selected = [True] * len(leaves) if selected is None else selected
  return [f"{jax.tree_util.keystr(path)} ({dtype_of(leaf)})"
          for (path, leaf), on in zip(leaves, selected)
          if on and jnp.issubdtype(dtype_of(leaf), jnp.complexfloating)]


def dtype_of(leaf: Any) -> jnp.dtype:
  """The leaf's dtype; a PRNG key's extended dtype (``key<fry>``) as it is,
  since ``jnp.dtype`` cannot interpret one."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return jnp.dtype(dtype or jnp.result_type(leaf))


# The research estimators' arguments, which live in optax_adama.contrib.
_CONTRIB_ARGUMENTS = ("nu_estimator", "split_floor")

Factory = TypeVar("Factory", bound=Callable[..., Any])
Made = TypeVar("Made")


def refuses_contrib_arguments(factory: Factory) -> Factory:
  """``factory``, refusing the arguments of :mod:`optax_adama.contrib` by name.

  A plain ``TypeError`` ("unexpected keyword argument") would not say where
  they went. The signature stays ``factory``'s (``functools.wraps``), so
  ``optax.inject_hyperparams`` reads it as before.
  """

  @functools.wraps(factory)
  def refusing(*args: Any, **kwargs: Any) -> Any:
    moved = [name for name in _CONTRIB_ARGUMENTS if name in kwargs]
    if moved:
      raise TypeError(
          f"{factory.__name__}() takes no {' or '.join(moved)}: the main "
          "transforms use the paper's estimator of v (\"mean\"), the one the "
          "evidence supports. The research estimators are in "
          f"optax_adama.contrib: optax_adama.contrib.{factory.__name__}(..., "
          f"{', '.join(f'{name}=...' for name in moved)}).")
    return factory(*args, **kwargs)

  return cast(Factory, refusing)


def takes_arguments_of(
    base: Callable[..., Any], *, positional_after: tuple[str, ...] = (),
    without: tuple[str, ...] = (),
) -> Callable[[Callable[..., Made]], Callable[..., Made]]:
  """A factory that takes ``base``'s arguments besides its own, written once, in ``base``.

  The decorated factory declares its own parameters and a ``**`` catch-all
  for ``base``'s (less ``without``), which it passes on. Its signature, as
  ``inspect`` (``optax.inject_hyperparams``, docs/api.md's test) and callers
  see it: its own positional parameters, ``base``'s, its own named in
  ``positional_after``; then, keyword-only, ``base``'s required ones, its
  own and ``base``'s others. ``adamaw(learning_rate, b1, ..., mu_dtype,
  weight_decay, mask, *, num_micro_batches, ...)`` is
  ``takes_arguments_of(scale_by_adama, positional_after=("weight_decay",
  "mask"), without=("rounding_seed",))`` over ``adamaw(learning_rate,
  weight_decay=1e-4, mask=None, **head_arguments)``. A call is bound to that
  signature (positional arguments land where it puts them, a wrong one
  raises the usual ``TypeError``) and reaches the factory by keyword.
  """
  kept = [p for p in inspect.signature(base).parameters.values() if p.name not in without]

  def extend(factory: Callable[..., Made]) -> Callable[..., Made]:
    signature = inspect.signature(factory)
    own = [p for p in signature.parameters.values()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = lambda params, after: [
        p for p in params
        if p.kind is p.POSITIONAL_OR_KEYWORD and (p.name in positional_after) == after]
    keyword = lambda params, required: [
        p for p in params if p.kind is p.KEYWORD_ONLY and (p.default is p.empty) == required]
    extended_signature = signature.replace(parameters=(
        positional(own, False) + positional(kept, False) + positional(own, True)
        + keyword(kept, True) + keyword(own, True) + keyword(own, False)
        + keyword(kept, False)))

    @functools.wraps(factory)
    def extended(*args: Any, **kwargs: Any) -> Made:
      return factory(**extended_signature.bind(*args, **kwargs).arguments)

    # What inspect.signature reads first (before following __wrapped__).
    extended.__signature__ = extended_signature  # type: ignore[attr-defined]
    return extended

  return extend
