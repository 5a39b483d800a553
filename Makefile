# The two commands: `make run` (the whole service on embedded defaults) and `make test` (the suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
# The suite on TEST_JOBS processes (pytest-xdist), whole files per process so module fixtures (a live service,
# a built world) are made once; TEST_JOBS=0 runs it in this process. Each process has its own databases and
# Redis db numbers (tests/fixtures_services.py `xdist_slot`).
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

.PHONY: run test install constraints lint browser test-unit test-services test-e2e test-browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[ml,dev]'
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

# constraints.txt pins every dependency at the versions the suite last passed with, so a clean clone installs
# what CI tested (pyproject.toml keeps the ranges the code supports). After upgrading in the venv and
# passing `make test`, rewrite it from the venv (torch is pinned above and by Dockerfile.gpu's base image).
constraints:
	{ echo '# Written by `make constraints` (Makefile): the versions `make test` last passed with.'; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt

# Debian's Chromium for the dashboard's browser tests (the registries are the only network here).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

run: install  # BLADE_PORT=8001 make run: another port
	$(VENV)/bin/blade up --data-dir ./var

# Every tier; a tier whose PostgreSQL, Redis or Chromium is missing fails (tests/tiers.py).
test: install browser
	$(PYTEST)

# The tiers one at a time: pure unit tests, service tests on the real PostgreSQL and Redis, end to end
# through HTTP with a real worker process, and the dashboard in a real headless Chromium.
test-unit: install
	$(PYTEST) -m "not services and not e2e and not browser"

test-services: install
	$(PYTEST) -m "services and not e2e and not browser"

test-e2e: install
	$(PYTEST) -m "e2e and not browser"

test-browser: install browser
	$(PYTEST) -m browser

# ruff (lint and format), the layer contracts (import-linter, [tool.importlinter] in pyproject.toml), mypy.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
