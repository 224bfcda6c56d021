# Two entry points for a fresh machine with Python 3.10+:
#   make demo   trains the tiny GPT with AdamA and with Adam + gradient
#               accumulation on the offline corpus, prints memory and loss.
#   make test   the test suite (heavy runs marked `slow` are left out).
# Both create .venv and install the package with its extras if needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all validate notebooks clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m models.train --compare

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -n 2

test-all: $(STAMP)
	$(BIN)/python -m pytest -n 2

validate: $(STAMP)
	$(BIN)/python -m models.validate

notebooks: $(STAMP)
	$(BIN)/python notebooks/build.py

clean:
	rm -rf $(VENV) build dist *.egg-info
