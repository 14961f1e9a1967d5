# hora CPU image: what a job needs to run hora's examples on CPU (hora, the CPU build of torch,
# numpy, scikit-learn, ipyparallel for session engines) on a minimal Debian base; for tests,
# CI and machines without a GPU.
# The docker runtime starts jobs in it (its container init and rank shim come with hora).
# Built by `hora image build --cpu`, which assembles the build context: this file and wheels/
# (hora and those packages at the versions of constraints/, made with `pip wheel` on the
# host, so nothing is downloaded inside the build). BASE: a Debian with python3 and venv
# (`hora image build --cpu` makes hora-base:bookworm with debootstrap when none is given).
ARG BASE=hora-base:bookworm
# The wheels are installed in a first stage and only the installed environment is copied into
# the image, so they take no layer of the result.
# hadolint ignore=DL3006
FROM ${BASE} AS deps
COPY wheels /tmp/wheels
# DL3013: the versions come from the wheels in the context (pinned by constraints/).
# --ignore-requires-python: the lock was made on a later 3.11 than Debian's 3.11.2, and a few
# pure-Python wheels ask for >=3.11.5 without needing it. hora's own dependencies (service,
# JupyterLab) are left out: jobs use only its data plane.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/hora \
    && /opt/hora/bin/pip install --no-cache-dir --no-index --ignore-requires-python \
       --find-links /tmp/wheels torch numpy scikit-learn ipyparallel

# hadolint ignore=DL3006
FROM ${BASE}
COPY --from=deps /opt/hora /opt/hora
# hora last, in a layer of its own: a change to hora rebuilds only this
COPY hora /tmp/hora
# hadolint ignore=DL3013,DL3059
RUN /opt/hora/bin/pip install --no-cache-dir --no-index --no-deps /tmp/hora/*.whl \
    && rm -rf /tmp/hora
ENV PATH=/opt/hora/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# jobs run as their owner's account (docker run --user); this is only the default
USER 65534
WORKDIR /tmp
