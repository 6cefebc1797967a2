# fastlock server image.  Build:   docker build -t fastlock .
# Run (credentials from `fastlock credentials init ./creds`, readable by uid 10001):
#   docker run -d -p 7420:7420 -v fastlock-data:/var/lib/fastlock -v "$PWD/creds:/etc/fastlock:ro" fastlock
# docs/deployment.md has the details (credentials, the healthcheck's token, a standby).

ARG PYTHON_VERSION=3.11

# -- builder: compile the Cython core into a wheel (needs a C compiler and Cython) --
FROM python:${PYTHON_VERSION}-slim AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY fastlock ./fastlock
# the fastlock wheel and the wheels of its dependencies, for an offline install below
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# -- runtime: the wheels only; no compiler, no Cython, no source tree --
FROM python:${PYTHON_VERSION}-slim AS runtime
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/fastlock --shell /usr/sbin/nologin fastlock \
    && mkdir -p /var/lib/fastlock /etc/fastlock \
    && chown fastlock:fastlock /var/lib/fastlock \
    && chmod 0700 /var/lib/fastlock
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels fastlock \
    && rm -rf /wheels
USER fastlock
WORKDIR /var/lib/fastlock
VOLUME ["/var/lib/fastlock"]
EXPOSE 7420
# the healthcheck's credential: any principal's token (the `app` client of `fastlock credentials init`)
ENV FASTLOCK_TOKEN_FILE=/etc/fastlock/app.token
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["fastlock", "status", "--server", "127.0.0.1:7420"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["fastlock"]
CMD ["serve", "--listen", "0.0.0.0:7420", "--data-dir", "/var/lib/fastlock", "--credentials", "/etc/fastlock/credentials.toml"]
