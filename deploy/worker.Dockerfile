# The remote worker's image: `agent-sandbox worker serve` on :8888 (see docs/scale-out.md).
# Built and pushed outside this repository's CI (there is no container daemon here):
#   python -m pip wheel --no-deps -w dist .
#   docker build -f deploy/worker.Dockerfile -t REGISTRY/agent-sandbox-worker:0.1.0 .
# The same Python minor version as the agents that call it (results cross as data, but the
# policy's schema and the code layer's parser are this version's).
FROM python:3.11-slim-bookworm

# libseccomp for the seccomp filter, bubblewrap so that `--provider auto` (the templates'
# choice under gVisor and Kata) has the same candidates as on a host (bwrap, then this
# package's own `unshare` launcher, then Landlock); nothing else from apt (no compilers, no
# shells beyond the base image's).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libseccomp2 bubblewrap \
 && rm -rf /var/lib/apt/lists/*

COPY dist/agent_sandbox_kit-*.whl /tmp/
RUN python -m pip install --no-cache-dir "$(ls /tmp/agent_sandbox_kit-*.whl)[seccomp]" \
 && rm /tmp/agent_sandbox_kit-*.whl \
 && python -m compileall -q "$(python -c 'import agent_sandbox, os; print(os.path.dirname(agent_sandbox.__file__))')"

# Non-root, matching the SandboxTemplate's runAsUser; the root filesystem is mounted
# read-only by the template, with an emptyDir at /tmp for the workers' scratch.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin worker
USER 10001:10001
ENV TMPDIR=/tmp PYTHONDONTWRITEBYTECODE=1
EXPOSE 8888
ENTRYPOINT ["agent-sandbox"]
CMD ["worker", "serve", "--listen", "tcp://0.0.0.0:8888", \
     "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key", \
     "--bind-secret-file", "/bind/secret", "--provider", "landlock"]
