#!/usr/bin/env bash
# Writes a test CA (ca.crt, ca.key) and a serving certificate for 127.0.0.1 and localhost signed
# by it (tls.crt, tls.key) into DIR, with openssl. The one generator of webhook certificates for
# loopback: the e2e harness (e2e/src/certs.rs) and the playground (e2e/playground.sh) both run it.
#
#   e2e/certs.sh DIR [CA-COMMON-NAME]
set -euo pipefail

dir=${1:?usage: certs.sh DIR [CA-COMMON-NAME]}
ca_cn=${2:-sharder-test-ca}
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=$ca_cn" -keyout ca.key -out ca.crt
openssl req -newkey rsa:2048 -nodes -subj "/CN=sharder" -keyout tls.key -out tls.csr
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 -extfile tls.ext -out tls.crt
