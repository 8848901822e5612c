#!/usr/bin/env bash
# Install a lavapipe (Mesa's software Vulkan device) that runs ggml-vulkan correctly.
#
# Debian 12 ships Mesa 22.3.6, whose lavapipe corrupts host memory under ggml-vulkan:
# llama.cpp's own `test-backend-ops -b Vulkan0 -o RMS_NORM_MUL_ADD` (and `-o TOPK_MOE`)
# abort there with heap corruption, and pyggspec's speculative graphs for 3+ sequences
# segfault inside it even with fusion off (the same graphs run on an RPC device).
# Mesa 25.0.7 from bookworm-backports passes those test-backend-ops cases (36/36, 416/416)
# and every device test. On other systems this does nothing: use the distribution's
# mesa-vulkan-drivers (Ubuntu 24.04 and later ship Mesa >= 24).
#
# Run as root. The backports suite is added next to the system's own Debian mirror (read
# from its apt sources), and only mesa-vulkan-drivers and what it needs come from it.
set -euo pipefail
. /etc/os-release
if [ "${ID:-}" != "debian" ] || [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  echo "lavapipe.sh: not Debian 12; keeping the distribution's lavapipe" >&2
  exit 0
fi
uri=""
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
  uri=$(awk '$1 == "deb" && $3 ~ /^bookworm/ {print $2; exit}' /etc/apt/sources.list)
fi
if [ -z "$uri" ]; then
  echo "lavapipe.sh: no Debian mirror found in the apt sources" >&2
  exit 1
fi
list=/etc/apt/sources.list.d/pyggspec-bookworm-backports.list
echo "deb $uri bookworm-backports main" > "$list"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports \
  mesa-vulkan-drivers >/dev/null
dpkg-query -W -f='lavapipe.sh: mesa-vulkan-drivers ${Version}\n' mesa-vulkan-drivers
