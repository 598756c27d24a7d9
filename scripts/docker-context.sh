#!/usr/bin/env bash
# Fills build/docker/rootfs with what the qvd image needs at run time, from this machine only:
# the freshly built binary and the shared libraries it links (OpenBLAS through cgo, and what
# that needs), found with ldd and copied with their symlinks resolved, plus the dynamic loader.
# The Dockerfile copies the directory into an image built FROM scratch: no base image, no
# package manager, nothing fetched. Also makes build/docker/cluster.key (the compose secret)
# if there is none.
#   scripts/docker-context.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
root=build/docker/rootfs
rm -rf "$root"
mkdir -p "$root/tmp" build/docker
chmod 1777 "$root/tmp"
go build -trimpath -o "$root/qvd" ./cmd/qvd
# ldd prints "name => /path (addr)" for libraries and "/path (addr)" for the loader.
ldd "$root/qvd" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(/ {print $1}' | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
# Where a library is found through a symlinked directory (/lib -> usr/lib on merged-/usr
# systems), ldd names the path the loader will also use, so the copies above are enough.
if [ ! -s build/docker/cluster.key ]; then
  (umask 077 && "$root/qvd" keygen > build/docker/cluster.key)
fi
du -sh "$root" | awk '{print "docker-context: " $1 " in " "'"$root"'"}'
