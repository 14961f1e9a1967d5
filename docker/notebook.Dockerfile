# hora notebook image: JupyterLab with the "Python 3 (hora)" kernel and its engines, and the
# job service, so `hora up` runs in a container too:
#   docker run --gpus all -p 8888:8888 -p 8000:8000 hora:notebook
# Built by `hora image build --notebook` on top of the GPU image (BASE, default hora:gpu).
ARG BASE=hora:gpu
# hadolint ignore=DL3006
FROM ${BASE}
USER 0
RUN hora kernel install --sys-prefix
USER 1000
WORKDIR /home/hora
EXPOSE 8888 8000
ENTRYPOINT []
CMD ["hora", "up", "--host", "0.0.0.0", "--port", "8000", "--lab-port", "8888"]
