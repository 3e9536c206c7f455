#!/bin/bash
# apt-install.sh PKG... - installs the Debian packages among PKG that are missing (only
# those, so a second run does nothing), with sudo when not root.
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
echo "apt-install: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
