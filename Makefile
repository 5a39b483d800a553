# The two commands: `make run` (the whole service on embedded defaults) and `make test` (the suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: run test install lint browser

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[ml,dev]'
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

# Debian's Chromium for the dashboard's browser tests (the registries are the only network here).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

run: install
	$(VENV)/bin/blade up --port 8000 --data-dir ./var

test: install browser
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .
