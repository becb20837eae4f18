# The two commands of the README: `make demo` (the main job) and `make test`.
VENV := .venv
PYTHON := $(VENV)/bin/python

VENV_NEXT := .venv-next
# The 0.7 line: git directories of NVIDIA-NeMo/Megatron-Bridge and NVIDIA/Megatron-LM (README, "The 0.7 line").
MEGATRON_BRIDGE_GIT ?=
MEGATRON_LM_GIT ?=

.PHONY: demo test test-fast test-next bench figures clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh
	./scripts/setup_venv.sh

# Megatron-Core warns at import that Transformer Engine / Apex / absl are absent: expected on the CPU.
QUIET_IMPORTS := -W "ignore:Transformer Engine:UserWarning" -W "ignore:absl:UserWarning"

demo: $(VENV)/.installed
	$(PYTHON) $(QUIET_IMPORTS) -m megatron.bridge_thd_cpu.demo

test: $(VENV)/.installed
	$(PYTHON) -m pytest -q tests

# The tier a developer runs on every change (under 2 minutes on 2 cores): tests/unit and tests/model,
# less the tests marked slow (tests/README.md). `make test` stays the whole suite, CI's command.
test-fast: $(VENV)/.installed
	$(PYTHON) -m pytest -q -m "not slow" tests/unit tests/model

$(VENV_NEXT)/.installed: pyproject.toml scripts/setup_venv_next.sh
	MEGATRON_BRIDGE_GIT="$(MEGATRON_BRIDGE_GIT)" MEGATRON_LM_GIT="$(MEGATRON_LM_GIT)" ./scripts/setup_venv_next.sh

# The whole suite on Megatron-Bridge's 0.7 line (docs/compatibility.md); `make test` stays the 0.6.2 suite.
test-next: $(VENV_NEXT)/.installed
	$(VENV_NEXT)/bin/python -m pytest -q tests

bench: $(VENV)/.installed
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/bench_pack.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/step_host_time.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/parity_report.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/bench_verl.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/edge_cases_report.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/cord_v2_sft.py --cpu-tiny
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/cord_v2_sft.py --cpu-tiny --recipe qwen35-vl-2b
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/training_loop_report.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/training_loop_report.py --model qwen35
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/global_batch_packing.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/global_batch_step_time.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/global_batch_scale.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/cp_per_sample_report.py
	$(PYTHON) $(QUIET_IMPORTS) benchmarks/time_model_report.py
	$(PYTHON) $(QUIET_IMPORTS) scripts/readme_figures.py

# Re-run the demo and rewrite every README figure block from the scripts that produce it.
figures: $(VENV)/.installed
	$(PYTHON) $(QUIET_IMPORTS) scripts/readme_figures.py --run demo

clean:
	rm -rf $(VENV) $(VENV_NEXT) .pytest_cache .hypothesis
