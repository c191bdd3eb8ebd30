# rackcast: the two quick-start commands.
#   make plan   plan Marin 535B-A23B on GB200 NVL72 racks with the embedded defaults and print the result
#   make test   run the test suite
# Each creates the virtual environment and installs the packages on first use; later runs reuse them.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: plan test setup clean

plan: $(STAMP)
	$(VENV)/bin/rackcast plan --model marin-535b-a23b --topology gb200-nvl72 --racks 11 --tokens 18e12

test: $(STAMP)
	$(PY) -m pytest -q

setup: $(STAMP)

# A machine that already has torch (a GPU build, say) keeps it: the venv sees system packages, and torch is only
# installed when missing, pinned to the CPU build 2.13.0.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info
