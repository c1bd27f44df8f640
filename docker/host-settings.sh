#!/bin/sh
# Installs into an image what docker/build.sh carried over from the build host into docker/local/
# (mounted at $1): apt sources and Acquire settings, extra CA certificates, a pip configuration.
# Does nothing for what is not there, so a plain `docker build` on a machine with internet keeps
# the base image's defaults.
set -eu
HOST="${1:?usage: host-settings.sh DIR}"

if [ -d "$HOST/apt/sources" ] && [ -n "$(ls -A "$HOST/apt/sources")" ]; then
  echo "host-settings: apt sources: $(ls "$HOST/apt/sources" | tr '\n' ' ')"
  rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*
  cp "$HOST"/apt/sources/* /etc/apt/sources.list.d/
fi
if [ -d "$HOST/apt/conf" ] && [ -n "$(ls -A "$HOST/apt/conf")" ]; then
  echo "host-settings: apt settings: $(ls "$HOST/apt/conf" | tr '\n' ' ')"
  cp "$HOST"/apt/conf/* /etc/apt/apt.conf.d/
fi
if [ -d "$HOST/ca-certificates" ] && [ -n "$(ls -A "$HOST/ca-certificates")" ]; then
  echo "host-settings: extra CA certificates: $(ls "$HOST/ca-certificates" | tr '\n' ' ')"
  if ! command -v update-ca-certificates >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates >/dev/null
    rm -rf /var/lib/apt/lists/*
  fi
  mkdir -p /usr/local/share/ca-certificates
  cp "$HOST"/ca-certificates/*.crt /usr/local/share/ca-certificates/
  update-ca-certificates >/dev/null
fi
if [ -f "$HOST/pip.conf" ]; then
  echo "host-settings: /etc/pip.conf:"; sed 's/^/  /' "$HOST/pip.conf"
  cp "$HOST/pip.conf" /etc/pip.conf
fi
