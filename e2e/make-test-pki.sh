#!/usr/bin/env bash
# Test PKI for etcd over TLS (tests only; throwaway keys, 2-day validity):
#   e2e/make-test-pki.sh DIR
# writes DIR/ca.{crt,key}, DIR/server.{crt,key} (SAN IP:127.0.0.1,
# DNS:localhost) and DIR/client.{crt,key}, both signed by the CA.
set -euo pipefail
dir="${1:?usage: make-test-pki.sh DIR}"
mkdir -p "$dir"
cd "$dir"
q() { openssl "$@" >/dev/null 2>&1 || { echo "make-test-pki.sh: openssl $1 failed" >&2; openssl "$@"; exit 1; }; }
q req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.crt -subj /CN=kvfabric-test-ca
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
for who in server client; do
  q req -newkey rsa:2048 -nodes -keyout "$who.key" -out "$who.csr" -subj "/CN=kvfabric-$who"
  q x509 -req -in "$who.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext -out "$who.crt"
done
rm -f ./*.csr san.ext ca.srl
