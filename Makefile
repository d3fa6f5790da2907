# dflash — two commands: `make train` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: help venv lint pytest test train status stop clean

help:
	@echo "make train   provision a local LXC container and train the tiny CPU config in it"
	@echo "make test    set up everything and run every test (lint, pytest, molecule)"
	@echo "make status  status of the training job(s) of the local inventory"
	@echo "make stop    stop the training job(s) of the local inventory"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[ops,dev]"
	touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check dflash tests bench

pytest: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
