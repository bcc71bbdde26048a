# The remote worker's image: `agent-sandbox worker serve` on :8888 (see docs/scale-out.md).
# Built and pushed outside this repository's CI (there is no container daemon here), from the
# repository's root, for the platform it runs on (the wheel is built inside, on that platform
# and Python; nothing built outside the image is copied in):
#   docker build -f deploy/worker.Dockerfile -t REGISTRY/agent-sandbox-worker:0.1.0 .
#   docker buildx build --platform linux/arm64 -f deploy/worker.Dockerfile ...   # another one
# The same Python minor version as the agents that call it (results cross as data, but the
# policy's schema and the code layer's parser are this version's).

# -- stage 1: the wheel, with its C extensions, built for this image's platform and Python --
FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The extensions are optional for a source install; the image requires them (the guards'
# fast import path and the namespace templates' init), so a wheel without them fails here.
RUN python -m pip wheel --no-cache-dir --no-deps -w /dist . \
 && python -c "import glob, sys, zipfile; \
names = zipfile.ZipFile(glob.glob('/dist/agent_sandbox_kit-*.whl')[0]).namelist(); \
missing = [m for m in ('_fastimport', '_fastscan', '_nsfork') \
           if not any(m in n and n.endswith('.so') for n in names)]; \
sys.exit('the wheel lacks its C extensions: %s' % missing if missing else 0)"

# -- stage 2: the runtime, without a compiler --------------------------------------------
FROM python:3.11-slim-bookworm

# libseccomp for the seccomp filter, bubblewrap so that `--provider auto` (the templates'
# choice under gVisor and Kata) has the same candidates as on a host (bwrap, then this
# package's own `unshare` launcher, then Landlock); nothing else from apt (no compilers, no
# shells beyond the base image's).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libseccomp2 bubblewrap \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /dist/ /tmp/dist/
RUN python -m pip install --no-cache-dir "$(ls /tmp/dist/agent_sandbox_kit-*.whl)[seccomp]" \
 && rm -rf /tmp/dist \
 && python -m compileall -q "$(python -c 'import agent_sandbox, os; print(os.path.dirname(agent_sandbox.__file__))')"

# Non-root, matching the SandboxTemplate's runAsUser; the root filesystem is mounted
# read-only by the template, with an emptyDir at /tmp for the workers' scratch.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin worker
USER 10001:10001
ENV TMPDIR=/tmp PYTHONDONTWRITEBYTECODE=1
EXPOSE 8888
ENTRYPOINT ["agent-sandbox"]
# The router hop (the templates' default): plain HTTP to the router in front, the bind
# secret from its Secret volume; the template's args replace this.
CMD ["worker", "serve", "--listen", "tcp://0.0.0.0:8888", "--plaintext", "accepted", \
     "--bind-secret-file", "/bind/secret", "--provider", "landlock"]
