# Set-up on a fresh machine: `make run` (the server on the embedded default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models/coserve-small
STAMP := $(VENV)/.coserve-installed

.PHONY: run test install bench clean

install: $(STAMP)

# --system-site-packages keeps a torch the machine already has (a CUDA build on a GPU host);
# where there is none, exactly torch==2.13.0 is installed (a local CPU wheel on these machines).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/coserve create-model $(MODEL) --preset small

# The OpenAI-compatible server on 127.0.0.1:8000 (no key on loopback); it prints how to call it.
run: $(STAMP) $(MODEL)/config.json
	$(VENV)/bin/coserve serve --model $(MODEL) --state-dir runs/state --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP) $(MODEL)/config.json
	$(VENV)/bin/coserve bench-generation --model $(MODEL) --out runs/bench_generation.json

clean:
	rm -rf $(VENV) models runs
