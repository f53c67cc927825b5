# Every entry point of the project. Each target echoes the command it runs (make's default), and every target that
# needs Python depends on the virtual environment, so `make demo` / `make test` work on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
WORLD   ?= data/tinyworld
SEED    ?= 0
export HF_HUB_OFFLINE ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-slow world index

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $@

test: install
	$(PY) -m pytest -q -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -m slow tests

# The built-in tiny world: corpus, questions, tokenizer, index and warm-start policy (DESIGN.md section 9).
world: install $(WORLD)/world.json

$(WORLD)/world.json:
	$(PY) data.py tinyworld --out $(WORLD) --seed $(SEED)

# Rebuild only the tiny world's dense index (e.g. after editing the corpus).
index: install
	$(PY) retriever.py build --corpus $(WORLD)/corpus.jsonl --encoder minilm --out $(WORLD)/index
