# The two commands of the README: `make demo` (the main job) and `make test`.
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh
	./scripts/setup_venv.sh

demo: $(VENV)/.installed
	$(PYTHON) -m megatron.bridge_thd.cli

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q tests

bench: $(VENV)/.installed
	$(PYTHON) benchmarks/bench_pack.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
