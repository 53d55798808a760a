# make demo: set up .venv with what the demo needs and train on sklearn digits with 2 local workers.
# make check: lint, format check, type check and the quick tier of tests (under 4 minutes on 2 cores).
# make test: set up .venv and run lint, format check, type check and the whole test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo check test lint clean

$(BIN)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	touch $@

# The demo needs Shoal, scikit-learn and tqdm only (the "examples" extra), not the test tools or TensorFlow.
$(BIN)/.demo: pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install --quiet -e '.[examples]'
	touch $@

$(BIN)/.installed: pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.demo
	$(BIN)/shoalrun -np 2 $(BIN)/python examples/digits.py

lint: install
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/mypy

check: lint
	$(BIN)/pytest -m check

# Two pytest workers (pytest-xdist): many tests wait on processes, sockets and timeouts, so two at once use the
# second core. Tests go one by one to whichever worker is free, longest modules first (tests/conftest.py), except
# that each xdist_group (Ray's tests, Spark's, Slurm's) stays on one worker, so that one cluster or JVM serves it. The
# few tests marked "alone" (a timing checked against a measurement) run afterwards, one at a time, instead of holding
# both workers while they wait for a quiet machine. The last line gives the tests' wall time. Shoal's modules are
# compiled once first, and the run may write bytecode even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): every rank, launcher and benchmark the suite starts would otherwise compile each Shoal
# module it imports again (about 0.1 s of CPU for shoal.torch and the launcher).
test: lint
	@start=$$(date +%s); export PYTHONDONTWRITEBYTECODE=; \
	$(BIN)/python -m compileall -q src tests examples >/dev/null; \
	$(BIN)/pytest -n 2 --dist loadgroup -m "not alone" && $(BIN)/pytest -m alone; \
	code=$$?; echo "make test: the tests took $$(( $$(date +%s) - start )) s (target: 600 s on 2 cores)"; exit $$code

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
