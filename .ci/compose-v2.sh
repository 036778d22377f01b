#!/usr/bin/env bash
# Docker Compose v2 (the `docker compose` CLI plugin) beside Debian bookworm's Compose v1.29, so
# that tests/stack/test_compose_stack.py runs the stack with both. Elsewhere Docker's packages ship
# the plugin; here no Docker repository is reachable, so it comes from Debian trixie's
# `docker-compose` package (Compose 2.x: a Go binary that needs only libc >= 2.34), fetched from
# the Debian mirror apt already uses and verified the way apt would (InRelease signed by a key of
# bookworm's debian-archive-keyring, then the Packages index's and the .deb's SHA256). It is
# unpacked, not installed: as a package it would replace v1's.
#
# Idempotent: nothing is done when `docker compose` answers. Needs root, curl, xz, gpgv.
set -euo pipefail

dest=${ZEROGAP_COMPOSE_V2:-/usr/local/lib/docker/cli-plugins/docker-compose} # the docker CLI searches there
suite=trixie
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

log() { echo "[compose-v2] $*"; }

if docker compose version >/dev/null 2>&1; then
  log "present: Compose $(docker compose version --short)"
  exit 0
fi

# The mirror of the first Debian source apt has (deb822 `URIs:` or one-line `deb` form).
mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
  | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
mirror=${mirror:-http://deb.debian.org/debian}
mirror=${mirror%/}
arch=$(dpkg --print-architecture)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsS --retry 3 -o "$tmp/InRelease" "$mirror/dists/$suite/InRelease"
gpgv --keyring "$keyring" "$tmp/InRelease" 2>/dev/null || { log "InRelease signature not valid"; exit 1; }
index="main/binary-$arch/Packages.xz"
want=$(awk -v f="$index" '/^SHA256:/ {s = 1; next} /^[^ ]/ {s = 0} s && $3 == f {print $1; exit}' "$tmp/InRelease")
curl -fsS --retry 3 -o "$tmp/Packages.xz" "$mirror/dists/$suite/$index"
echo "$want  $tmp/Packages.xz" | sha256sum -c --quiet
xz -dc "$tmp/Packages.xz" >"$tmp/Packages"
field() { awk -v k="$1:" '/^Package: docker-compose$/ {p = 1} p && $1 == k {print $2; exit}' "$tmp/Packages"; }
file=$(field Filename)
sha=$(field SHA256)
[ -n "$file" ] && [ -n "$sha" ] || { log "no docker-compose package in $suite"; exit 1; }
curl -fsS --retry 3 -o "$tmp/compose.deb" "$mirror/$file"
echo "$sha  $tmp/compose.deb" | sha256sum -c --quiet
dpkg-deb -x "$tmp/compose.deb" "$tmp/x"
install -D -m 0755 "$tmp/x/usr/libexec/docker/cli-plugins/docker-compose" "$dest"
log "Compose $("$dest" version --short) from $mirror/$file"
