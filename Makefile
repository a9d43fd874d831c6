# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch where this machine offers one (a local wheel); otherwise pip's default for the platform.
TORCH  ?= torch==2.13.0

.PHONY: venv test test-fast demo ablate-demo scaling-demo lint clean

# The rest through uv (pinned here: pip's resolver took most of an install), every version held by constraints.txt
UV     ?= uv==0.13.10

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "$(UV)"
	$(VENV)/bin/uv pip install --python $(PY) -q -c constraints.txt -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# pytest-xdist workers (-n; 0: one process). 0 until the suite is green under load: make test TEST_WORKERS=4 took
# 26:56 against 43:19 in one process, with a step of the gpu_run dry run past its limit (bench/results/suite_*);
# a file is one group (tests/conftest.py). --durations: the slowest tests, in CI's log (the budget is 20 minutes)
TEST_WORKERS ?= 0
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=40 tests

# The quick loop: everything but the tests marked slow (SLURM, DDP, SIGTERM, subprocess workers, long trainings).
test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

# The main job on the built-in offline data: train the demo recipe on gettext:de (CPU), average the last
# checkpoints, decode the held-out test split with beam search, print sacreBLEU / chrF and examples.
DEMO ?= experiments/demo_en_de.yaml
demo: venv
	$(VENV)/bin/attnlab demo -c $(DEMO)

# A small ablation of the demo task on the CPU: ReLU vs SwiGLU x 3 seeds, each trial evaluated as the recipe says,
# 2 local workers; re-running it only runs what is missing. Prints the table (final scores, p-values and CIs of the
# differences to the baseline; also written as CSV and LaTeX) and writes the plots.
ABLATION ?= ablations/demo_significance.yaml
ablate-demo: venv
	$(VENV)/bin/attnlab ablate run $(ABLATION) --workers 2
	$(VENV)/bin/attnlab ablate table $(ABLATION)
	$(VENV)/bin/attnlab ablate plot $(ABLATION)

SCALING ?= ablations/scaling_demo.yaml
scaling-demo: venv
	$(VENV)/bin/attnlab ablate run $(SCALING) --workers 2
	$(VENV)/bin/attnlab ablate scaling $(SCALING)

lint: venv
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
