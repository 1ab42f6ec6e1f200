# Rendered by `provision build` from dockerfiles/cell.Dockerfile.j2 for cell cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6; do not edit.
# base: registry-free; builder: BuildKit
FROM stackprobe/base-dev:bookworm-4a3a48f4
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_COMPILE_BYTECODE=0 UV_NO_CACHE=1
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; python3 -m venv /opt/uv && /opt/uv/bin/pip install --quiet uv==0.13.9
# CUDA toolkit from the registry's wheels (nvcc, headers with CCCL, nvvm, cudart) assembled into CUDA_HOME,
# plus a libcuda stub so JIT modules link without a driver (the driver's libcuda is used at run time). The
# stub exports every driver function in cuda.h: one that lacks a called function lets the linker drop the
# libcuda.so.1 dependency, and the module then fails to load on the GPU host (undefined symbol).
COPY toolkit.lock /opt/stackprobe/toolkit.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /usr/bin/python3 --target /opt/cuda-wheels --no-deps --require-hashes \
        -r /opt/stackprobe/toolkit.lock \
    && rm -rf /opt/cuda-wheels/nvidia/*/lib/libcublas*.so* /opt/cuda-wheels/nvidia/*/lib/libnvblas.so* /opt/cuda-wheels/nvidia/*/lib/libcurand*.so* \
    && mkdir -p /usr/local/cuda \
    && for d in /opt/cuda-wheels/nvidia/*/; do cp -rsn "$d". /usr/local/cuda/; done \
    && rm -rf /usr/local/cuda/.metadata /usr/local/cuda/__pycache__ \
    && cd /usr/local/cuda && { [ -e lib64 ] || ln -s lib lib64; } \
    && for f in lib/lib*.so.[0-9]*; do b="${f%%.so.*}.so"; [ -e "$b" ] || ln -s "$(basename "$f")" "$b"; done \
    && mkdir -p lib/stubs && grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\b' include/cuda.h | sort -u \
        | sed 's/.*/void &(void){}/' > /tmp/stub.c && test -s /tmp/stub.c \
    && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o lib/stubs/libcuda.so /tmp/stub.c && rm /tmp/stub.c \
    && /usr/local/cuda/bin/nvcc --version
ENV CUDA_HOME=/usr/local/cuda VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/cuda/bin:$PATH
RUN python3 -m venv /opt/venv
COPY torch.lock /opt/stackprobe/torch.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes \
        -r /opt/stackprobe/torch.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so* /opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so* /opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*
COPY requirements.lock /opt/stackprobe/requirements.lock
RUN --mount=type=secret,id=cacert if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert PIP_CERT=/run/secrets/cacert; fi; /opt/uv/bin/uv pip sync --python /opt/venv/bin/python --require-hashes \
        /opt/stackprobe/requirements.lock \
    && rm -rf /opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/cu12 /opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.*
RUN printf '%s\n' '/opt/cuda-wheels/nvidia/*/lib/libcublas*.so*' '/opt/cuda-wheels/nvidia/*/lib/libnvblas.so*' '/opt/cuda-wheels/nvidia/*/lib/libcurand*.so*' '/opt/venv/lib/python3*/site-packages/nvidia/*/lib/libcusolver*.so*' '/opt/venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn_[!g]*.so*' '/opt/venv/lib/python3*/site-packages/triton/backends/nvidia/lib/cupti*' '/opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/cu12' '/opt/venv/lib/python3*/site-packages/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.*' > /opt/stackprobe/removed
LABEL org.stackprobe.cell="cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6" \
      org.stackprobe.cuda="13.2" \
      org.stackprobe.torch="2.15.0" \
      org.stackprobe.torch_cuda="cu132" \
      org.stackprobe.sgl_kernel="none" \
      org.stackprobe.flashinfer="0.7.4"
