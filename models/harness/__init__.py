"""The harness: what trains and measures the zoo's models, below the commands.

The commands (`python -m models.train`, `.bench`, `.plan`, `.validate`,
`.demo`, `.gpu_bench`) are front ends (their arguments, `main` and what they
print); what they run lives here, one module per job:

- `settings`: a training run's settings (`TrainConfig`) and what they build
  (`make_optimizer`, `model_config_of`, the warm-up cosine schedule);
- `loop`: the training loop (`train`, checkpointed and resumed with
  `CheckpointOptions`; `make_train_step`, `make_data`, `train_step_shardings`);
- `baselines`: the accumulation methods AdamA is compared with
  (`make_step`, the floor each is held to, interleaved timing);
- `reporting`: where a result was measured, bytes, figures, loss curves;
- `checks`: a user's settings refused in one line naming the flag;
- `batches`: batches to compile and to time;
- what one command runs: `capacity` (the capacity search of `models.bench
  capacity`, reused by `models.gpu_bench --capacity` and a benchmark script),
  `memory` (`models.bench memory`'s compile-only table), `gpu` and
  `gpu_report` (`models.gpu_bench`'s processes and tables), `study` and
  `study_plots` (`models.validate study | rho | curves`).

This front names what the commands and scripts share
(`from models import harness; harness.train(...)`); a tool of one command is
imported as its module (`from models.harness import capacity`). The harness
imports the zoo (`models`) and `optax_adama`, never a command, and the zoo
never imports it (tests/project/test_imports.py holds both).
"""

from models.harness.baselines import ESTIMATOR_METHODS
from models.harness.baselines import FSDP_METHODS
from models.harness.baselines import LOW_RANK_REFRESH_PERIOD
from models.harness.baselines import METHODS
from models.harness.baselines import RELEASE_METHODS
from models.harness.baselines import SHARDED_METHODS
from models.harness.baselines import STATE_METHODS
from models.harness.baselines import Step
from models.harness.baselines import adama_floor
from models.harness.baselines import check_method
from models.harness.baselines import dtype_override
from models.harness.baselines import floor_for
from models.harness.baselines import fsdp_shardings
from models.harness.baselines import make_step
from models.harness.baselines import measure_throughput
from models.harness.baselines import split_model
from models.harness.batches import abstract_batch
from models.harness.batches import packed_text_batches
from models.harness.batches import random_batch
from models.harness.batches import tokens_per_example
from models.harness.batches import uses_packed_text
from models.harness.batches import weigh_targets
from models.harness.capacity import gpt_family
from models.harness.checks import as_flags
from models.harness.checks import check_counts
from models.harness.checks import check_seq_len
from models.harness.checks import command_errors
from models.harness.devices import SHARD_STATES
from models.harness.devices import add_device_args
from models.harness.devices import make_mesh
from models.harness.devices import mesh_devices_of
from models.harness.devices import place_batch
from models.harness.devices import stage_of
from models.harness.devices import start_processes
from models.harness.loop import CheckpointOptions
from models.harness.loop import check_run
from models.harness.loop import evaluate
from models.harness.loop import make_data
from models.harness.loop import make_train_step
from models.harness.loop import train
from models.harness.loop import train_step_shardings
from models.harness.reporting import GIB
from models.harness.reporting import cpu_name
from models.harness.reporting import format_bytes
from models.harness.reporting import machine_info
from models.harness.reporting import plot_loss_curves
from models.harness.reporting import running_mean
from models.harness.reporting import save_figure
from models.harness.settings import CAUSAL_LM_KINDS
from models.harness.settings import DEFAULT_NU_ESTIMATOR
from models.harness.settings import MODEL_KIND_OF_CONFIG
from models.harness.settings import MODEL_KINDS
from models.harness.settings import MOMENT_DTYPES
from models.harness.settings import NU_ESTIMATOR_NAMES
from models.harness.settings import OPTIMIZERS
from models.harness.settings import PARAM_DTYPES
from models.harness.settings import PARAM_ROUNDINGS
from models.harness.settings import TrainConfig
from models.harness.settings import adama_transform
from models.harness.settings import base_model_config
from models.harness.settings import make_optimizer
from models.harness.settings import model_config_of
from models.harness.settings import param_rounding
from models.harness.settings import warmup_cosine_schedule
from models.harness.settings import weight_decay_mask

__all__ = [
    "abstract_batch",
    "adama_floor",
    "adama_transform",
    "add_device_args",
    "as_flags",
    "base_model_config",
    "CAUSAL_LM_KINDS",
    "check_counts",
    "check_method",
    "check_run",
    "check_seq_len",
    "CheckpointOptions",
    "command_errors",
    "cpu_name",
    "DEFAULT_NU_ESTIMATOR",
    "dtype_override",
    "ESTIMATOR_METHODS",
    "evaluate",
    "floor_for",
    "format_bytes",
    "FSDP_METHODS",
    "fsdp_shardings",
    "GIB",
    "gpt_family",
    "LOW_RANK_REFRESH_PERIOD",
    "machine_info",
    "make_data",
    "make_mesh",
    "make_optimizer",
    "make_step",
    "make_train_step",
    "measure_throughput",
    "mesh_devices_of",
    "METHODS",
    "model_config_of",
    "MODEL_KIND_OF_CONFIG",
    "MODEL_KINDS",
    "MOMENT_DTYPES",
    "NU_ESTIMATOR_NAMES",
    "OPTIMIZERS",
    "packed_text_batches",
    "PARAM_DTYPES",
    "param_rounding",
    "PARAM_ROUNDINGS",
    "place_batch",
    "plot_loss_curves",
    "random_batch",
    "RELEASE_METHODS",
    "running_mean",
    "save_figure",
    "SHARD_STATES",
    "SHARDED_METHODS",
    "split_model",
    "stage_of",
    "start_processes",
    "STATE_METHODS",
    "Step",
    "tokens_per_example",
    "train",
    "train_step_shardings",
    "TrainConfig",
    "uses_packed_text",
    "warmup_cosine_schedule",
    "weigh_targets",
    "weight_decay_mask",
]
