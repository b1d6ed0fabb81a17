# Sourced by the Dockerfile's pip steps (bind-mounted, never in a layer): the proxy's CA (BuildKit secret `ca`)
# joins the system roots and an index's pip.conf (secret `pip`) is used, for that RUN only; the caller removes
# /tmp/pki before the RUN ends.
if [ -s /build/ca.pem ]; then
  mkdir -p /tmp/pki && cat /etc/ssl/certs/ca-certificates.crt /build/ca.pem > /tmp/pki/roots.pem
  export PIP_CERT=/tmp/pki/roots.pem
fi
if [ -s /build/pip.conf ]; then export PIP_CONFIG_FILE=/build/pip.conf; fi
