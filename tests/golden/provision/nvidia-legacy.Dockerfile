# Rendered by `provision build` from dockerfiles/cell.Dockerfile.j2 for cell cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1; do not edit.
# base: nvidia; builder: legacy
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=0 UV_NO_CACHE=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates libnuma1 \
    && rm -rf /var/lib/apt/lists/*
RUN if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; python3 -m venv /opt/uv && /opt/uv/bin/pip install --quiet uv==0.13.9
ENV CUDA_HOME=/usr/local/cuda VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/cuda/bin:$PATH
RUN python3 -m venv /opt/venv
COPY torch.lock /opt/stackprobe/torch.lock
RUN if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes \
        -r /opt/stackprobe/torch.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so* /opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so* /opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*
# sgl-kernel alone (kernel.lock): a layer shared by the cells of one torch build and one sgl-kernel
COPY kernel.lock /opt/stackprobe/kernel.lock
RUN if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes \
        -r /opt/stackprobe/kernel.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/sgl_kernel/flash_ops*.so
COPY requirements.lock /opt/stackprobe/requirements.lock
RUN if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip sync --python /opt/venv/bin/python --require-hashes \
        /opt/stackprobe/requirements.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/cu12 /opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.*
RUN printf '%s\n' '/opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so*' '/opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so*' '/opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*' '/opt/venv/lib/python3*/site-packages/sgl_kernel/flash_ops*.so' '/opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/cu12' '/opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.*' > /opt/stackprobe/removed
LABEL org.stackprobe.cell="cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1" \
      org.stackprobe.cuda="13.0" \
      org.stackprobe.torch="2.11.0" \
      org.stackprobe.torch_cuda="cu130" \
      org.stackprobe.sgl_kernel="0.4.2" \
      org.stackprobe.flashinfer="0.6.8.post1"
