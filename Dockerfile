# tether: reverse-proxy sidecar in front of an LLM inference server.
#
#   docker build -t tether .
#   docker run --rm --network host -e TETHER_UPSTREAM_URL=http://127.0.0.1:8000 \
#     -e TETHER_ADMIN_HOST=127.0.0.1 tether
#
# Configured only by TETHER_* environment variables (see deploy/README.md and config/*.env).
# The same image also carries the bundled fake engine for demos:
#   docker run --rm --network host --entrypoint tether-fake-engine tether --port 8000
#
# BASE must be a Debian-like image (apt) with python3 >= 3.11 and the venv module; CI builds a
# local stand-in tagged python:3.11-slim, so this file stays the standard one.
ARG BASE=python:3.11-slim

# ---- build: a self-contained virtualenv in /opt/tether ------------------------------------
FROM ${BASE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A C compiler, and Python's headers where the base has none (Debian's own python3): pip
# compiles the data plane with mypyc (setup.py). This stage only; the runtime stage has neither.
# Not pinned: the base's own Debian release decides the versions, as it does for the base.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
         DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-dev; \
       fi \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/tether

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy/ proxy/
COPY tether_fake_engine/ tether_fake_engine/

# Install tether (bytecode is compiled now, so the read-only runtime never needs to write it),
# check that the image runs the compiled data plane (a build that fell back to pure Python
# fails here), then drop the installers: the runtime image has no pip, no setuptools, no
# build cache.
RUN /opt/tether/bin/pip install --no-cache-dir . \
    && /opt/tether/bin/python -m pip uninstall --yes pip setuptools wheel \
    && /opt/tether/bin/python -I -c "import proxy.compiled as c; print('data plane:', c.extensions()); assert c.extensions() == 'compiled'" \
    && test -x /opt/tether/bin/tether

# ---- runtime -----------------------------------------------------------------------------
FROM ${BASE}

LABEL org.opencontainers.image.title="tether" \
      org.opencontainers.image.description="Sidecar for LLM inference servers: aborts abandoned requests upstream, keeps request IDs unique"

# A fixed, unprivileged UID/GID (Kubernetes runAsUser / runAsGroup use the same numbers).
RUN groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin tether

COPY --from=build /opt/tether /opt/tether

# PYTHONDONTWRITEBYTECODE: nothing is written at run time, so a read-only root FS works.
# TETHER_ADMIN_HOST: tether's own default is loopback, but in a container the kubelet's
# probes, Prometheus and the other replicas reach the admin port on the container's address.
# With --network host, set it back to 127.0.0.1 (deploy/README.md).
ENV PATH=/opt/tether/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TETHER_ADMIN_HOST=0.0.0.0

# tether reads an optional .env from its working directory: mount one at /etc/tether/.env
# if env vars are inconvenient. The directory is empty in the image.
WORKDIR /etc/tether

USER 10001:10001

# 8080: clients (TETHER_PORT). 9090: /healthz /readyz /metrics /admin (TETHER_ADMIN_PORT).
EXPOSE 8080 9090

# Liveness of tether itself (not of the engine: that is /readyz). slim has no curl, so the
# check is python's urllib against the admin port tether is configured with.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; h = os.environ.get('TETHER_ADMIN_HOST', '') or '127.0.0.1'; h = {'0.0.0.0': '127.0.0.1', '::': '::1'}.get(h, h); h = '[' + h + ']' if ':' in h else h; u.urlopen('http://%s:%s/healthz' % (h, os.environ.get('TETHER_ADMIN_PORT', '9090')), timeout=2)"]

# Exec form: tether is PID 1 and receives SIGTERM itself (graceful drain, then exit 0).
# tether starts no child processes, so there is nothing for an init to reap.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tether"]
