"""The training steps ``oom_reports.py`` compiles, one per method, on a mesh's
``"data"`` axis (FSDP: every leaf split along its largest axis).

The baselines are written as their users write them: ``scan_accumulation`` as a
hand-written FSDP loop, ``maxtext_accumulation`` as MaxText's train step
accumulates, ``multisteps`` as ``optax.MultiSteps`` is stepped (one jitted call a
micro-batch); the AdamA methods go through the library's own steps.
"""

from __future__ import annotations


def largest_axis_shardings(tree, mesh, axis="data"):
  """Each leaf split along its largest axis the mesh divides (the first of equals),
  as FSDP users write it by hand and as ``step_shardings(..., "fsdp")`` splits it."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec

  size = mesh.shape[axis]

  def spec(x):
    dims = [d for d, n in enumerate(x.shape) if n % size == 0 and n >= size]
    if not dims:
      return NamedSharding(mesh, PartitionSpec())
    dim = max(dims, key=lambda d: x.shape[d])
    return NamedSharding(mesh, PartitionSpec(*([None] * dim), axis))

  return jax.tree.map(spec, tree)


def hand_written_accumulation(loss_fn, tx, params, mesh, num_micro_batches):
  """Adam + FSDP scan accumulation as a user writes it: (jitted step, param shardings)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec

  param_shardings = largest_axis_shardings(params, mesh)
  rows = NamedSharding(mesh, PartitionSpec(None, "data"))

  def step(params, opt_state, batch):
    n = num_micro_batches
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                         batch)
    micro = jax.lax.with_sharding_constraint(micro, jax.tree.map(lambda _: rows, micro))

    def body(acc, micro_batch):
      grads = jax.grad(loss_fn)(params, micro_batch)
      grads = jax.lax.with_sharding_constraint(grads, param_shardings)
      return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), None

    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc = jax.lax.with_sharding_constraint(acc, param_shardings)
    acc, _ = jax.lax.scan(body, acc, micro)
    grads = jax.tree.map(lambda a, p: (a / n).astype(p.dtype), acc, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1)), param_shardings


def maxtext_accumulation(loss_fn, tx, params, mesh, num_micro_batches):
  """Adam + scan accumulation as MaxText writes it (``gradient_accumulation_loss_and_grad``
  in src/maxtext/utils/gradient_accumulation.py, read at e591f30, float32 params, no
  ZeRO-1 cast): the params constrained to their split and carried through the scan, a
  zero gradient in the params' dtype constrained to the same split, nothing constrained
  inside the body, the micro-batches strided (``reshape(B / n, n)`` then swapped), the
  sum constrained again and divided after the scan: (jitted step, param shardings)."""
  import jax
  import jax.numpy as jnp
  import optax

  param_shardings = largest_axis_shardings(params, mesh)
  constrain = lambda tree: jax.lax.with_sharding_constraint(tree, param_shardings)

  def step(params, opt_state, batch):
    n = num_micro_batches
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                         batch)

    def body(carry, micro_batch):
      grads = jax.grad(loss_fn)(carry["ga_params"], micro_batch)
      return dict(carry, grad=jax.tree.map(lambda g, a: g + a, grads, carry["grad"])), None

    ga_params = constrain(params)
    init = {"grad": constrain(jax.tree.map(jnp.zeros_like, ga_params)), "ga_params": ga_params}
    carry, _ = jax.lax.scan(body, init, micro, length=n)
    grads = jax.tree.map(lambda g: g / n, constrain(carry["grad"]))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1)), param_shardings


def multisteps_micro_step(loss_fn, tx, params, mesh):
  """One ``optax.MultiSteps`` update per micro-batch, as its users call it."""
  import jax
  import optax

  param_shardings = largest_axis_shardings(params, mesh)

  def step(params, opt_state, micro_batch):
    grads = jax.grad(loss_fn)(params, micro_batch)
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1)), param_shardings


def model_parts(config):
  """(plain loss, staged loss, abstract params) of a config; no staged loss (None)
  where its layers are unrolled."""
  import jax
  from flax import nnx

  import models

  model = models.create_abstract(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  staged = models.staged_loss(model)[0] if config.scan_layers else None
  return models.make_loss_fn(graphdef, rest), staged, params


def offloads(method: str) -> bool:
  """Whether ``method`` keeps its moments in host memory."""
  return "_offload" in method


def bf16_params(method: str) -> bool:
  """Whether ``method`` stores its params in bfloat16 (compiled so)."""
  return method.endswith("_bf16")


def adama_tx(method, n, mu_dtype=None):
  import jax.numpy as jnp

  import optax_adama

  quantization = optax_adama.BlockQuantization() if "_8bit" in method else None
  if bf16_params(method):  # float32 moments, updates rounded stochastically
    tx = optax_adama.mini_batch_chain(
        optax_adama.adamaw(1e-5, num_micro_batches=n, mu_dtype=jnp.float32,
                           nu_dtype=jnp.float32, quantization=quantization),
        optax_adama.contrib.round_params_stochastically())
  else:
    tx = optax_adama.adamaw(1e-5, num_micro_batches=n, quantization=quantization,
                            mu_dtype=mu_dtype)
  return optax_adama.offload_moments(tx) if offloads(method) else tx


def compile_method(method, n, loss_fn, staged, params, batch, mesh, compiler_options=None,
                   mu_dtype=None):
  """(compiled step, its optimizer state's shapes), compiled with ``compiler_options``
  (a target's: a TPU program over HBM still reports its bytes); ``mu_dtype``: the
  first moment's dtype (None: the params')."""
  import jax
  import optax

  import optax_adama

  place = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  if method.startswith(("scan_accumulation", "multisteps", "maxtext_accumulation")):
    adam = optax.adam(1e-5, mu_dtype=mu_dtype)
    tx = optax.MultiSteps(adam, every_k_schedule=n) if method == "multisteps" else adam
    state = jax.eval_shape(tx.init, params)
    if method == "multisteps":
      step, shardings = multisteps_micro_step(loss_fn, tx, params, mesh)
      batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]),
                                                          x.dtype), batch)
    else:
      accumulation = (maxtext_accumulation if method == "maxtext_accumulation"
                      else hand_written_accumulation)
      step, shardings = accumulation(loss_fn, tx, params, mesh, n)
    state_shardings = largest_axis_shardings(state, mesh)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = place(batch, jax.tree.map(lambda _: rows, batch))
    compiled = step.lower(place(params, shardings), place(state, state_shardings),
                          batch).compile(compiler_options=compiler_options)
    return compiled, state
  tx = adama_tx(method, n, mu_dtype)
  state = jax.eval_shape(tx.init, params)
  if method == "adama_per_call":
    step, shardings = multisteps_micro_step(loss_fn, tx, params, mesh)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    micro_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (x.shape[0] // n, *x.shape[1:]), x.dtype, sharding=rows), batch)
    compiled = step.lower(place(params, shardings),
                          place(state, largest_axis_shardings(state, mesh)),
                          micro_batch).compile(compiler_options=compiler_options)
    return compiled, state
  if offloads(method):
    state = optax_adama.moments.offloaded_state_shapes(state)
  if method == "adama":
    step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=n, mesh=mesh,
                                       shard_states="fsdp")
    shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states="fsdp")
  elif method == "adama_staged":
    step = optax_adama.microbatch_step(staged, tx, num_micro_batches=n, mesh=mesh,
                                       shard_states="fsdp")
    shardings = optax_adama.sharding.stack_shardings(staged, params, state, mesh,
                                                     shard_states="fsdp")
  else:
    step = optax_adama.release_step(staged, tx, mesh=mesh, shard_states="fsdp")
    shardings = optax_adama.sharding.release_shardings(staged, params, state, mesh,
                                                       shard_states="fsdp")
  compiled = step.lower(place(params, shardings.params), place(state, shardings.opt_state),
                        batch).compile(compiler_options=compiler_options)
  return compiled, state


def device_bytes(compiled, state, method, devices):
  """One device's compiled bytes; host-offloaded moments not counted."""
  import optax_adama

  total = optax_adama.memory_report(compiled, param_bytes=1).total_bytes
  if offloads(method) and compiled.memory_analysis().host_argument_size_in_bytes == 0:
    # The CPU backend counts host-memory arguments with the device's.
    total -= optax_adama.moments.host_state_bytes(state) // devices
  return total
