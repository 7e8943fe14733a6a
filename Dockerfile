# pinpriq-server in a slim image, listening on every interface of the container, as an
# unprivileged user, keeping its packets in the volume /data. Options given to
# `docker run IMAGE ...` replace CMD and go to the server, after the ENTRYPOINT's --host and
# --data-dir, so `docker run pinpriq --max-memory 2GiB` keeps listening on every interface and
# keeps its log.
#
# Two stages (issue 14): the full python image has a C compiler and Python's headers, and
# builds a wheel whose hot modules mypyc compiles; the slim image, which has neither, installs
# that wheel. Both are the same Python on the same Debian release, so the extensions load.
FROM python:3.11-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY pinpriq ./pinpriq
# wire-fixtures/ is package data (pinpriq.fixtures): pinpriq-conformance reads it in the image.
COPY wire-fixtures ./wire-fixtures
# setup.py falls back to plain Python when compiling fails; the image must not, so a wheel
# without the compiled modules' shared library fails the build here.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && python -c "import glob, sys, zipfile; [w] = glob.glob('/wheels/*.whl'); \
sys.exit(not any(n.startswith('pinpriq__mypyc') for n in zipfile.ZipFile(w).namelist()))"

FROM python:3.11-slim-bookworm
# A numeric user (hadolint DL3066), so orchestrators can tell it is not root without a passwd.
# /data belongs to that user: the server creates its log there.
RUN useradd --create-home --uid 10001 pinpriq && mkdir /data && chown 10001 /data
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels

USER 10001
# 7000: the data port. 7001: the admin listener (dashboard, /metrics, /stats, /healthz), which
# listens on the container's loopback only unless given --http-host 0.0.0.0 and a token.
EXPOSE 7000 7001
# The log: mount a named volume or a host directory here (docker run -v pinpriq-data:/data) so
# packets outlive the container.
VOLUME ["/data"]
# The admin listener's /healthz on the container's loopback: it needs no token, and it answers
# only while the server's Trio run is alive (its /readyz says 503 while the log is read back;
# the minute's start period covers millions of packets). Without a token the server refuses
# clients from Docker's network and its start-up log says to run the image with
# -e PINPRIQ_AUTH_TOKEN=... (see the README, "Running pinpriq safely"). With --tls-cert the
# admin listener speaks HTTPS: set PINPRIQ_ADMIN_URL=https://127.0.0.1:7001 and SSL_CERT_FILE to
# the CA's file.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["pinpriq", "--timeout", "3", "health"]
ENTRYPOINT ["pinpriq-server", "--host", "0.0.0.0", "--data-dir", "/data"]
CMD ["--port", "7000"]
