#!/bin/sh
# Builds the Go example offline from Debian's packages (no Go module proxy):
#   golang-go, golang-google-grpc-dev, golang-google-protobuf-dev and
#   golang-github-golang-protobuf-1-5-dev (Go sources under /usr/share/gocode),
#   protoc-gen-go (APIv2: knows proto3 `optional`), protoc-gen-go-grpc, protobuf-compiler.
# GOPATH mode: the stubs are generated into $OUT/gopath/src/zerogap/v1 (their
# go_package), grpc and protobuf come from /usr/share/gocode; Go's own build cache
# (~/.cache/go-build) makes a rebuild take a second or two.
#   ./build.sh [OUT]    (default ~/.cache/zerogap/clients/go; binary: OUT/bin/zerogap-example)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
proto=$(cd "$here/../../proto" && pwd)
out=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/zerogap/clients/go}
mkdir -p "$out/bin" "$out/gopath/src"
export GO111MODULE=off GOFLAGS= GOPATH="$out/gopath:/usr/share/gocode"
protoc -I "$proto" --go_out="$out/gopath/src" --go-grpc_out="$out/gopath/src" "$proto/zerogap/v1/generation.proto"
go build -o "$out/bin/zerogap-example" "$here/main.go"
echo "$out/bin/zerogap-example"
