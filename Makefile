# The two commands of the README: `make demo` (the main job) and `make test`.
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh
	./scripts/setup_venv.sh

# Megatron-Core warns at import that Transformer Engine / Apex / absl are absent: expected on the CPU.
QUIET_IMPORTS := -W "ignore:Transformer Engine:UserWarning" -W "ignore:absl:UserWarning"

demo: $(VENV)/.installed
	$(PYTHON) $(QUIET_IMPORTS) -m megatron.bridge_thd.cli

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q tests

bench: $(VENV)/.installed
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/bench_pack.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/parity_report.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/bench_verl.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
