# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch where this machine offers one (a local wheel); otherwise pip's default for the platform.
TORCH  ?= torch==2.13.0

.PHONY: venv test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

lint: venv
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
