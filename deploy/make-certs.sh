#!/usr/bin/env sh
# A private CA and the certificates the TLS stack (deploy/compose.tls.yml) uses:
#   ca.pem            the CA every party trusts
#   zerogap.pem/.key  the replicas (name "zerogap", as nginx checks it)
#   lb.pem/.key       the load balancer, for clients (names lb, localhost, 127.0.0.1)
#   client.pem/.key   a client certificate: nginx to the replicas, and their healthcheck
# Usage: deploy/make-certs.sh [DIR] (default deploy/certs). Keep DIR out of git.
set -eu
dir=${1:-"$(dirname "$0")/certs"}
mkdir -p "$dir"
cd "$dir"
key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "$@" 2>/dev/null; }
key -x509 -days 825 -keyout ca.key -out ca.pem -subj /CN=zerogap-stack-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
leaf() {  # name subject-alt-names extended-key-usage
    key -keyout "$1.key" -out "$1.csr" -subj "/CN=$1"
    printf '%s\nextendedKeyUsage=%s\n' "$2" "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
        -out "$1.pem" -extfile "$1.ext" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
leaf zerogap "subjectAltName=DNS:zerogap" serverAuth
leaf lb "subjectAltName=DNS:lb,DNS:localhost,IP:127.0.0.1" serverAuth
leaf client "subjectAltName=DNS:client" clientAuth
chmod 644 ./*.pem ./*.key  # read by the non-root zerogap user and nginx in their containers
echo "certificates in $(pwd)"
