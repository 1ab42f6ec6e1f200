# Rendered by `provision build` from dockerfiles/cell.Dockerfile.j2 for cell cu128-torch2.9.1-sgl0.4.1-fi0.6.17; do not edit.
# base: registry-free-notoolkit; builder: BuildKit
FROM stackprobe/base:bookworm-20aff611
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=0 UV_NO_CACHE=1
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; python3 -m venv /opt/uv && /opt/uv/bin/pip install --quiet uv==0.13.9
ENV CUDA_HOME=/usr/local/cuda VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/cuda/bin:$PATH
RUN python3 -m venv /opt/venv
COPY torch.lock /opt/stackprobe/torch.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes \
        -r /opt/stackprobe/torch.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so* /opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so* /opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*
# sgl-kernel alone (kernel.lock): a layer shared by the cells of one torch build and one sgl-kernel
COPY kernel.lock /opt/stackprobe/kernel.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes \
        -r /opt/stackprobe/kernel.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/sgl_kernel/flash_ops*.so
COPY requirements.lock /opt/stackprobe/requirements.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip sync --python /opt/venv/bin/python --require-hashes \
        /opt/stackprobe/requirements.lock
RUN printf '%s\n' '/opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so*' '/opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so*' '/opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*' '/opt/venv/lib/python3*/site-packages/sgl_kernel/flash_ops*.so' > /opt/stackprobe/removed
LABEL org.stackprobe.cell="cu128-torch2.9.1-sgl0.4.1-fi0.6.17" \
      org.stackprobe.cuda="12.8" \
      org.stackprobe.torch="2.9.1" \
      org.stackprobe.torch_cuda="cu128" \
      org.stackprobe.sgl_kernel="0.4.1" \
      org.stackprobe.flashinfer="0.6.17"
