#!/usr/bin/env bash
# Prepare this machine as a local LXC host for dflash (`make train`, molecule).
# Idempotent and fast when everything is already in place.
#
# Usage: scripts/host-setup.sh [VENV]   (VENV: the controller venv, default .venv)
set -euo pipefail

venv="${1:-.venv}"
# lxc + debootstrap: the local container backend; lxc-dev, gcc, pkg-config: build the
# Python `lxc` bindings that the community.general.lxc connection imports;
# openssh-server: the loopback node of the proxmox molecule scenario; g++: torch.compile's CPU
# code generation (the compiled-loss test); prometheus (promtool) and prometheus-node-exporter: the metrics tests
# (tests/ansible/test_ansible_metrics.py, molecule faults).
packages=(lxc lxc-dev debootstrap openssh-server gcc g++ pkg-config python3-dev rsync prometheus prometheus-node-exporter)

if [[ $EUID -ne 0 ]]; then
  echo "host-setup: needs root (creates LXC containers); run it as root" >&2
  exit 2
fi

missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "host-setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "$venv/bin/python" ]]; then
  echo "host-setup: controller venv $venv is missing (make venv creates it)" >&2
  exit 2
fi
if ! "$venv/bin/python" -c 'import lxc' 2>/dev/null; then
  echo "host-setup: building the Python lxc bindings into $venv"
  "$venv/bin/python" -m pip install -q "lxc>=3.0.4,<4"
fi

# The containers share one pip cache (fast re-provisioning) and one rootfs cache.
install -d -m 0755 /var/cache/dflash /var/cache/dflash/pip /var/cache/dflash/rootfs
echo "host-setup: ok"
