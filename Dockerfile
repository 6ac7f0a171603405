# syntax=docker/dockerfile:1
# Two images from one build: `--target operator` (kopf controller, no torch) and `--target trainer`
# (torchrun workers). The trainer defaults to a CPU base; for GPUs build it on a CUDA base whose
# Python is 3.11+, e.g. --build-arg TRAINER_BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
# (torch is then already installed and pip keeps it, since the range is torch>=2.4).
ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG TRAINER_BASE=python:3.11-slim-bookworm

FROM ${PYTHON_BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
COPY docker/ docker/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python docker/operator_requirements.py pyproject.toml > /wheels/operator-requirements.txt

FROM ${PYTHON_BASE} AS operator
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir -r /wheels/operator-requirements.txt \
 && pip install --no-cache-dir --no-deps /wheels/sgdjob-*.whl \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin sgdjob
USER 10001
EXPOSE 8080 9090
ENTRYPOINT ["sgdjob"]
CMD ["operator", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]

FROM ${TRAINER_BASE} AS trainer
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/sgdjob-*.whl \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin sgdjob
USER 10001
WORKDIR /home/sgdjob
EXPOSE 9400 29400
ENTRYPOINT ["torchrun"]
CMD ["-m", "sgdjob_trainer", "--config", "/etc/sgdjob/run.yaml"]
