"""models/ presets: parameter counts against the published sizes and a closed form."""

from __future__ import annotations

import jax
import pytest
from _models_helpers import KINDS
from _models_helpers import closed_form_count
from flax import nnx

import models

# Published sizes: GPT-2 (Radford et al. 2019, as counted by HF transformers),
# BERT (Devlin et al. 2019), ViT (Dosovitskiy et al. 2021, table 1).
PUBLISHED = {
    "gpt2_small": 124e6,
    "gpt2_medium": 355e6,
    "gpt2_large": 774e6,
    "gpt2_xl": 1558e6,
    "bert_base": 110e6,
    "bert_large": 335e6,
    "vit_base": 86e6,
    "vit_large": 304e6,
    # Llama (Touvron et al. 2023; Meta's model cards, as counted by HF transformers).
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama32_1b": 1_235_814_400,
}


# Building the abstract 36- and 48-layer GPT-2 large and XL takes 6-10 s on 2
# cores: they run with the slow tests. Every preset's size, theirs included,
# is checked against the published one by the closed form just below.
SLOW_PRESETS = ("gpt2_large", "gpt2_xl", "llama2_7b", "llama3_8b")


def test_every_preset_has_its_published_size_in_closed_form():
  for name, published in PUBLISHED.items():
    count = closed_form_count(models.PRESETS[name])
    assert abs(count - published) / published < 0.01, (name, count)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_PRESETS else name
    for name in sorted(PUBLISHED)])
def test_preset_param_counts(name):
  model = models.create_abstract(name)
  # eval_shape allocated nothing: the parameters are shape/dtype placeholders.
  assert all(
      isinstance(leaf, jax.ShapeDtypeStruct)
      for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  count = models.param_count(model)
  assert count == closed_form_count(models.PRESETS[name])
  assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_small_presets(kind):
  config = models.PRESETS[f"{kind}_tiny"]
  assert 2 <= config.num_layers <= 4 and 64 <= config.hidden <= 128
  assert models.param_count(f"{kind}_tiny") == closed_form_count(config)
  test = models.PRESETS[f"{kind}_test"]
  assert test.num_layers == 1 and test.hidden == 128
  concrete = models.create(f"{kind}_test", rngs=nnx.Rngs(0))
  assert models.param_count(concrete) == closed_form_count(test)


def test_presets_are_frozen_and_hashable():
  config = models.PRESETS["gpt2_small"]
  with pytest.raises(AttributeError):
    config.hidden = 1  # type: ignore[misc]
  assert len({hash(c) for c in models.PRESETS.values()}) == len(models.PRESETS)
  assert models.get_config("gpt2_small", remat="full").remat == "full"
  assert models.PRESETS["gpt2_small"].remat == "none"
