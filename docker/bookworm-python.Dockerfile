# A stand-in for python:3.11-slim-bookworm, for when no container registry can be reached: Debian
# 12's own Python 3.11 with venv, pip and the headers (the public image has them too), on a Debian
# 12 base that docker/build.sh makes with debootstrap (localhost/bookworm-base) and builds this on,
# from the repository root.
ARG BASE=localhost/bookworm-base
FROM ${BASE}
ARG HOST_FILES=none
COPY docker/host-settings.sh /usr/local/sbin/host-settings.sh
RUN --mount=type=bind,source=docker/local,target=/tmp/host \
    sh /usr/local/sbin/host-settings.sh /tmp/host \
 && apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-venv python3-pip python3-dev ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8
CMD ["python3"]
