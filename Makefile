# Two commands do all set-up on a fresh machine that has only Python:
#   make demo   creates .venv on first use, installs memfit, runs the main job
#   make test   creates .venv if needed, runs the default test suite
# Both install the exact versions in constraints.txt (the ones the suite last passed with).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := pip==26.3
LATEST := .venv-latest
# memfit's dependencies (runtime + dev extra), names only: what test-latest upgrades to the newest releases
DEP_NAMES = $(shell $(PYTHON) -c "import re, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	print(' '.join(sorted({re.split('[<>=!~ ;\\[]', d)[0] for d in p['dependencies'] + p['optional-dependencies']['dev']})))")

.PHONY: demo test test-slow test-latest lock bench lint clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(PIP)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The suite against the newest releases of every dependency (upper bounds ignored), in its own venv.
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip $(DEP_NAMES)
	$(LATEST)/bin/python -m pip install --quiet --no-deps -e .
	$(LATEST)/bin/python -m pytest -q

# After test-latest passed: pin what it installed (then raise pyproject.toml's upper bounds to match).
lock:
	test -x $(LATEST)/bin/pip || { echo "run make test-latest first"; exit 2; }
	{ sed -n '/^#/p' constraints.txt; $(LATEST)/bin/pip freeze --exclude-editable | grep -v '^memfit'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

bench: $(STAMP)
	$(BIN)/python -m bench.accuracy
	$(BIN)/python -m bench.estimate_speed

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info src/*.egg-info .pytest_cache
