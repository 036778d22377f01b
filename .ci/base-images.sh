#!/usr/bin/env bash
# The base images the Dockerfile and docker-compose.yml name (python:3.11-slim,
# nginx:1.27), made locally when no registry can supply them. Elsewhere they are
# simply pulled; here (no image registry reachable) they are built from a Debian
# bookworm minbase root filesystem (debootstrap) and tagged with those names, so
# the Dockerfile and the compose file stay the ones a user runs anywhere.
#
#   python:3.11-slim  bookworm's python3 (3.11) + pip + venv; `python`/`pip` on PATH,
#                     pip allowed to install system-wide (as in the official image)
#   nginx:1.27        bookworm's nginx (1.22), `nginx -g 'daemon off;'` in the foreground
#
# This machine reaches PyPI only through an HTTPS proxy: its CA certificates
# (/usr/local/share/ca-certificates/*.crt) go into both images, and PIP_CERT /
# SSL_CERT_FILE / REQUESTS_CA_BUNDLE point at the resulting bundle.
#
# Idempotent: an image that exists (or can be pulled) is left alone; the
# debootstrap tarball is cached in $ZEROGAP_CI_CACHE (default /var/cache/zerogap-ci).
# Needs root (debootstrap), a running dockerd and the `debootstrap` package.
set -euo pipefail

cache=${ZEROGAP_CI_CACHE:-/var/cache/zerogap-ci}
base=zerogap-ci/bookworm-minbase:latest
images=(python:3.11-slim nginx:1.27)

log() { echo "[base-images] $*"; }

missing=()
for img in "${images[@]}"; do
  if docker image inspect "$img" >/dev/null 2>&1; then
    continue
  fi
  if timeout 60 docker pull -q "$img" >/dev/null 2>&1; then
    log "pulled $img"
  else
    missing+=("$img")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  log "present: ${images[*]}"
  exit 0
fi
log "no registry supplies ${missing[*]}: building them from Debian bookworm (debootstrap)"

mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1 || true)
mirror=${mirror:-http://deb.debian.org/debian}

if ! docker image inspect "$base" >/dev/null 2>&1; then
  tarball=$cache/bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { echo "debootstrap not installed (apt-get install debootstrap)" >&2; exit 1; }
    mkdir -p "$cache"
    root=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    t0=$(date +%s)
    debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
      || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # Container hygiene: no apt caches, no host-specific files.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
    : >"$root/etc/hostname"
    tar -C "$root" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    rm -rf "$root"
    trap - EXIT
    log "debootstrap bookworm minbase: $(( $(date +%s) - t0 )) s"
  fi
  docker import --change 'CMD ["bash"]' "$tarball" "$base" >/dev/null
  log "imported $base"
fi

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/ca"
cp /usr/local/share/ca-certificates/*.crt "$ctx/ca/" 2>/dev/null || true
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" >"$ctx/sources.list"

build() {  # tag, Dockerfile text on stdin
  local t0
  t0=$(date +%s)
  cat >"$ctx/Dockerfile"
  DOCKER_BUILDKIT=0 docker build -q -t "$1" "$ctx" >/dev/null 2>"$ctx/build.err" \
    || { grep -v -i 'deprecat\|buildx\|legacy builder' "$ctx/build.err" >&2; exit 1; }
  log "built $1 ($(( $(date +%s) - t0 )) s)"
}

common="FROM $base
COPY sources.list /etc/apt/sources.list
COPY ca/ /usr/local/share/ca-certificates/
ENV LANG=C.UTF-8 \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt"

for img in "${missing[@]}"; do
  case $img in
    python:3.11-slim)
      build "$img" <<EOF
$common
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        ca-certificates python3 python3-pip python3-venv \\
    && update-ca-certificates \\
    && ln -sf /usr/bin/python3 /usr/local/bin/python \\
    && ln -sf /usr/bin/pip3 /usr/local/bin/pip \\
    && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \\
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
EOF
      ;;
    nginx:1.27)
      build "$img" <<EOF
$common
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        ca-certificates nginx \\
    && update-ca-certificates \\
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* \\
    && ln -sf /dev/stdout /var/log/nginx/access.log \\
    && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
EOF
      ;;
    *)
      echo "no recipe for $img" >&2
      exit 1
      ;;
  esac
done
