# Two entry points, each bootstraps its own environment in .venv:
#   make demo   - set up and run the main job (fkv demo: CPU, NIXL between processes)
#   make test   - set up and run the test suite (what CI runs)
# and one for benchmark results (docs/benchmarks.md):
#   make report - regenerate README/NOTES tables and docs/plots from bench/results/
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.fkv-installed

.PHONY: demo test venv report

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first, pinned: on this machine 2.13.0 is a CPU wheel on disk; a bare "torch" would pull CUDA builds
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fkv demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests examples/quickstart.ipynb --nbmake

report: $(STAMP)
	$(VENV)/bin/fkv bench report --plots docs/plots
