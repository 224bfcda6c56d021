"""The convergence cost of bfloat16 params: AdamA with float32 against bfloat16 params.

    python benchmarks/scripts/bf16_params.py --seeds 0 1 2 \
        --out benchmarks/results/convergence/raw/bf16_params.json \
        --markdown benchmarks/results/convergence/bf16_params.md \
        --plot benchmarks/results/convergence/bf16_params.png
    python benchmarks/scripts/bf16_params.py --seeds 0 --steps 20 --out /tmp/b.json \
        --markdown /tmp/b.md --plot /tmp/b.png      # a smoke run, seconds

The protocol of ``models.validate`` for gpt_tiny (same data order and initial
weights per seed, held-out loss at the end), AdamA's default at N = 4 with
float32 moments in every arm, so the params' storage is the only difference:

- ``float32``: float32 params (the reference);
- ``bf16_stochastic``: bfloat16 params, each update applied with stochastic
  rounding (``optax_adama.contrib.round_params_stochastically``);
- ``bf16_nearest``: bfloat16 params under optax's add (round to nearest), what a
  user gets by casting the params alone;
- two float32 diagnostics (``--arms``, not run by default): ``f32_bf16_start``,
  float32 params started from their bfloat16-rounded values, and
  ``f32_bf16_grads``, float32 params whose gradients are rounded to bfloat16 as
  a bfloat16 param's are: what of bfloat16 storage a gap comes from;
  ``bf16_stochastic_f32_vectors``: ``bf16_stochastic`` with the vectors (norm
  scales, biases: 0.1% of gpt_tiny's bytes) kept float32;
  ``f32_bf16_forward``: float32 params and updates, the forward and backward
  passes computed on the params rounded to bfloat16 (straight through): the
  weights' precision in the model without the rounding of their storage;
  ``f32_bf16_passes``: ``f32_bf16_forward`` and ``f32_bf16_grads`` together, the
  passes as bfloat16 storage makes them (weights and gradients at bfloat16
  precision) with float32 storage;
  ``bf16_stochastic_reseeded``: ``bf16_stochastic`` with other rounding noise
  (the rounding's seed offset by 1,000; data and initial weights unchanged):
  whether a seed's gap is the noise drawn or systematic;
  ``f32_rounding_noise``: float32 params, each update given zero-mean Gaussian
  noise of the variance stochastic rounding to bfloat16 adds on average
  (``s**2 / 6``, ``s`` the bfloat16 spacing at the new value): the rounding's
  noise without its grid; ``f32_bf16_passes_noise``: both at once, bfloat16
  storage but for the grid.

The target (the capacity of benchmarks/results/memory/capacity_fsdp_8_devices.md rests on it):
``bf16_stochastic`` within 1% of ``float32`` in held-out loss, mean of the seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import models
from models import harness
from models import validate

NUM_MICRO_BATCHES = 4
ARMS = {"float32": {"param_dtype": "float32"},
        "bf16_stochastic": {"param_dtype": "bfloat16", "param_rounding": "stochastic"},
        "bf16_nearest": {"param_dtype": "bfloat16", "param_rounding": "nearest"},
        "bf16_stochastic_f32_vectors": {"param_dtype": "bfloat16",
                                        "param_rounding": "stochastic"},
        "f32_bf16_start": {"param_dtype": "float32"},
        "f32_bf16_grads": {"param_dtype": "float32"},
        "f32_bf16_forward": {"param_dtype": "float32"},
        "f32_bf16_passes": {"param_dtype": "float32"},
        "bf16_stochastic_reseeded": {"param_dtype": "bfloat16", "param_rounding": "stochastic"},
        "f32_rounding_noise": {"param_dtype": "float32"},
        "f32_bf16_passes_noise": {"param_dtype": "float32"}}
# The rounding noise's seed in ``bf16_stochastic_reseeded``: the run's seed plus this.
RESEED_OFFSET = 1000
DEFAULT_ARMS = ("float32", "bf16_stochastic", "bf16_nearest")


@jax.custom_vjp
def _bf16_cotangent(x):
  """The identity whose gradient is rounded to bfloat16, as a bfloat16 param's is."""
  return x


_bf16_cotangent.defvjp(lambda x: (x, None),
                       lambda _, g: (g.astype(jnp.bfloat16).astype(g.dtype),))


def _bf16_forward(x):
  """``x`` rounded to bfloat16 in value, the identity in gradient (straight through)."""
  return x + jax.lax.stop_gradient(x.astype(jnp.bfloat16).astype(x.dtype) - x)


def _bf16_spacing(x):
  """The distance between the two bfloat16 values around each entry of ``x``
  (8 significant bits: ``2**(e - 8)`` for ``x`` in ``[2**(e - 1), 2**e)``)."""
  _, exponent = jnp.frexp(x)
  return jnp.ldexp(jnp.ones_like(x), exponent - 8)


def rounding_noise(seed: int) -> optax.GradientTransformation:
  """Adds to each float32 update the noise of stochastic rounding to bfloat16
  in variance, off the grid: Gaussian, zero mean, ``s**2 / 6`` (the mean of
  ``f * (1 - f) * s**2`` over the fraction ``f`` of a spacing ``s`` the value
  lies past its lower neighbour)."""
  def update_fn(updates, count, params):
    leaves, treedef = jax.tree.flatten(updates)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), count), len(leaves))
    noisy = [u + jax.random.normal(k, u.shape, u.dtype) * _bf16_spacing(p + u) / np.sqrt(6.0)
             for u, p, k in zip(leaves, treedef.flatten_up_to(params), keys)]
    return jax.tree.unflatten(treedef, noisy), count + 1

  return optax.GradientTransformation(lambda _: jnp.zeros([], jnp.uint32), update_fn)


@contextlib.contextmanager
def _diagnostic(arm: str) -> Iterator[None]:
  """The model zoo's and the harness's hooks patched for a diagnostic arm (none
  for the three arms of the target)."""
  create, split_loss_fn = models.create, models.split_loss_fn
  param_rounding = harness.param_rounding

  def created_with(leaf_fn):  # models.create, each param leaf mapped by leaf_fn
    def patched(config, *, rngs, **overrides):
      graphdef, params, rest = nnx.split(create(config, rngs=rngs, **overrides), nnx.Param, ...)
      return nnx.merge(graphdef, jax.tree.map(leaf_fn, params), rest)
    return patched

  def loss_on(leaf_fn):  # models.split_loss_fn, the loss taking leaf_fn of each param
    def patched(model, **kwargs):
      loss_fn, params = split_loss_fn(model, **kwargs)
      return (lambda p, *a, **k: loss_fn(jax.tree.map(leaf_fn, p), *a, **k)), params
    return patched

  rounded_create = created_with(lambda p: p.astype(jnp.bfloat16).astype(p.dtype))
  float32_vectors = created_with(lambda p: p.astype(jnp.float32) if p.ndim <= 1 else p)
  rounded_grads = loss_on(_bf16_cotangent)
  forward_in_bf16 = loss_on(_bf16_forward)
  passes_in_bf16 = loss_on(lambda x: _bf16_forward(_bf16_cotangent(x)))

  def reseeded_rounding(config):
    return param_rounding(dataclasses.replace(config, seed=config.seed + RESEED_OFFSET))

  noise = lambda config: rounding_noise(config.seed)
  # Per diagnostic arm, the hooks it replaces for its run.
  hooks = {
      "f32_bf16_start": [(models, "create", rounded_create)],
      "bf16_stochastic_f32_vectors": [(models, "create", float32_vectors)],
      "f32_bf16_grads": [(models, "split_loss_fn", rounded_grads)],
      "f32_bf16_forward": [(models, "split_loss_fn", forward_in_bf16)],
      "f32_bf16_passes": [(models, "split_loss_fn", passes_in_bf16)],
      "bf16_stochastic_reseeded": [(harness, "param_rounding", reseeded_rounding)],
      "f32_rounding_noise": [(harness, "param_rounding", noise)],
      "f32_bf16_passes_noise": [(models, "split_loss_fn", passes_in_bf16),
                                (harness, "param_rounding", noise)],
  }
  with contextlib.ExitStack() as stack:
    for module, name, replacement in hooks.get(arm, []):
      stack.enter_context(mock.patch.object(module, name, replacement))
    yield


def run(arm: str, seed: int, steps: int, preset: str = "gpt_tiny",
        learning_rate: float | None = None) -> dict:
  """One training run of ``arm``: its held-out loss, losses and compiled memory."""
  settings = {**validate.SETTINGS["gpt"], "steps": steps}
  if learning_rate is not None:
    settings["learning_rate"] = learning_rate
  config = harness.TrainConfig(model="gpt", preset=preset, optimizer="adama",
                               num_micro_batches=NUM_MICRO_BATCHES, seed=seed,
                               mu_dtype="float32", nu_dtype="float32", **ARMS[arm], **settings)
  with _diagnostic(arm):
    result = harness.train(config, progress=False)
  return {"arm": arm, "seed": seed, "preset": preset,
          "learning_rate": settings["learning_rate"], "eval_loss": result["eval_loss"],
          "train_loss": result["train_loss"], "memory": result["memory"],
          "machine": result["machine"]}


def table(runs: list[dict], command: str) -> str:
  """The markdown table: per arm the seeds' held-out losses against float32's."""
  reference = {r["seed"]: r["eval_loss"] for r in runs if r["arm"] == "float32"}
  # Runs made before preset and rate were recorded: gpt_tiny at models.validate's.
  preset_rates = sorted({(r.get("preset", "gpt_tiny"),
                          r.get("learning_rate", validate.SETTINGS["gpt"]["learning_rate"]))
                         for r in runs})
  trained = ", ".join(f"{preset} at {rate:g}" for preset, rate in preset_rates)
  lines = [f"Made by `{command}` on {runs[0]['machine'].get('cpu', 'CPU')}. {trained}, "
           f"AdamA (\"mean\") at N = {NUM_MICRO_BATCHES}, float32 moments, otherwise the "
           "settings of `models.validate` (32 x 64 tokens per step); held-out loss at the end.",
           "",
           "| params | seeds | held-out loss, mean ± std | vs float32 (mean) | per seed "
           "| compiled step |", "|---|---|---|---|---|---|"]
  for arm in ARMS:
    mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
    if not mine:
      continue
    losses = np.array([r["eval_loss"] for r in mine])
    paired = [f"{100 * (r['eval_loss'] / reference[r['seed']] - 1):+.2f}%"
              for r in mine if r["seed"] in reference]
    relative = (f"{100 * (losses.mean() / np.mean([reference[r['seed']] for r in mine]) - 1):+.2f}%"
                if arm != "float32" and len(paired) == len(mine) else "")
    memory = mine[0]["memory"]
    lines.append(f"| {arm} | {len(mine)} | {losses.mean():.4f} ± {losses.std():.4f} | "
                 f"{relative} | {', '.join(paired) if arm != 'float32' else ''} | "
                 f"{memory['total_bytes'] / 2**20:.1f} MiB |")
  return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
  """Training loss (running mean) of every run: one colour per arm, one line style per seed."""
  import matplotlib

  colours = matplotlib.colormaps["tab20"].colors
  seeds = sorted({r["seed"] for r in runs})
  styles = ("-", "--", ":", "-.")
  harness.plot_loss_curves(
      runs, lambda r: f"{r['arm']} (seed {r['seed']})", path,
      style=lambda r: {"color": colours[list(ARMS).index(r["arm"]) % len(colours)],
                       "linestyle": styles[seeds.index(r["seed"]) % len(styles)]})


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=validate.SETTINGS["gpt"]["steps"])
  parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(DEFAULT_ARMS))
  parser.add_argument("--preset", default="gpt_tiny", help="a GPT preset (gpt_test: a smoke run)")
  parser.add_argument("--learning-rate", type=float, default=None,
                      help="the peak rate; default: models.validate's for GPT (2e-3)")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--markdown", type=Path, required=True)
  parser.add_argument("--plot", type=Path)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.steps < 1 or min(args.seeds) < 0:
    parser.error("--steps must be 1 or more and --seeds non-negative.")
  if args.learning_rate is not None and args.learning_rate <= 0:
    parser.error("--learning-rate must be positive.")
  # Runs of other arms and seeds already in --out are kept (a diagnostic is
  # added without running the rest again), with the commands that made them.
  previous = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
  runs = [r for r in previous["runs"] if (r["seed"], r["arm"]) not in
          {(s, a) for s in args.seeds for a in args.arms}]
  kept = previous.get("commands") or previous.get("command", "").split("; ")
  commands = list(dict.fromkeys([c for c in kept if c] * bool(runs)
                                + ["python benchmarks/scripts/bf16_params.py " + " ".join(argv)]))
  command = "; ".join(commands)
  jobs = [(seed, arm) for seed in args.seeds for arm in args.arms]
  for seed, arm in tqdm(jobs, desc="runs"):
    runs.append(run(arm, seed, args.steps, args.preset, args.learning_rate))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "commands": commands, "runs": runs},
                                   indent=1))
    args.markdown.write_text(table(runs, command))
  if args.plot:
    plot(runs, args.plot)
  print(table(runs, command))
  return runs


if __name__ == "__main__":
  main()
