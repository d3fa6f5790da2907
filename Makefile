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
	$(VENV)/bin/ruff check dflash tests bench library module_utils connection_plugins

pytest: $(STAMP)
	$(VENV)/bin/pytest -q --durations=25

test: host-setup lint pytest molecule

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

train: host-setup
	$(ANSIBLE_ENV) ansible-playbook -i $(LOCAL_INVENTORY) playbooks/train.yml $(TRAIN_ARGS)
	@echo
	@echo "Training runs in the LXC container $(LOCAL_CONTAINER), as the systemd unit $(LOCAL_JOB).service there."
	@echo "  log:         /var/log/dflash/$(LOCAL_JOB).log  (host path: /var/lib/lxc/$(LOCAL_CONTAINER)/rootfs/var/log/dflash/$(LOCAL_JOB).log)"
	@echo "  heartbeat:   /var/lib/dflash/runs/$(LOCAL_JOB)/heartbeat.json"
	@echo "  checkpoints: /var/lib/dflash/runs/$(LOCAL_JOB)/checkpoints/"
	@echo "  follow:      lxc-attach -n $(LOCAL_CONTAINER) -- tail -F /var/log/dflash/$(LOCAL_JOB).log"
	@echo "  status:      make status   (exit 0 training/starting/stopped/finished, 1 hung/crashed/failed-to-start)"
	@echo "  restart:     make train TRAIN_ARGS=\"-e dflash_job_state=restarted\""
	@echo "  stop:        make stop"

# Exit status for scripts: 0 healthy or stopped on purpose, 1 unhealthy, 2 bad input.
status: $(STAMP)
	$(ANSIBLE_ENV) $(VENV)/bin/dflash ops status -i $(LOCAL_INVENTORY)

stop: $(STAMP)
	$(ANSIBLE_ENV) ansible-playbook -i $(LOCAL_INVENTORY) playbooks/stop.yml

# Every molecule scenario (real LXC containers; see docs/operations.md).
# The whole log is kept in .molecule.log; on a failure its failed tasks are printed again at the end.
molecule: host-setup
	set -o pipefail; $(ANSIBLE_ENV) molecule test --all 2>&1 | tee .molecule.log \
		|| { scripts/show-failures.sh .molecule.log; exit 1; }

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .molecule.log
