#!/usr/bin/env bash
# Install a real SGLang server (sglang 0.5.23) for CPU into its own virtual environment.
# Usage: install.sh VENV_DIR [--build-kernel]
# Needs: Python 3.11, the package registries, a CPU with Intel AMX for serving (amx_bf16 in /proc/cpuinfo).
#
# The CPU kernel (module sgl_kernel) is not on the registries. Its source lies next to this script
# (sgl-kernel-src-*.tar.gz, Apache-2.0). The kernel wheel is taken from the first of:
#   1. $SGLANG_KERNEL_CACHE (default: ../shared/sglang-cpu beside the repository), a folder of prebuilt
#      sglang_kernel_cpu-*.whl: a cache that machines of one kind share;
#   2. .cache/sglang-kernel/ in the repository: the wheel an earlier run of this script built;
#   3. a build from the source (gcc, cmake, scikit-build-core, libnuma-dev; installed when missing), whose wheel goes
#      into .cache/sglang-kernel/. Measured: 1143 s (19 min) on 2 cores shared with a test run (load 9-13, the
#      build at nice 19), about 5 min of CPU time; the shared folder's note gives 4-6 min on 2 idle cores.
# --build-kernel skips 1 and 2.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:?usage: install.sh VENV_DIR [--build-kernel]}
build=${2:-}
shared_cache=${SGLANG_KERNEL_CACHE:-$repo/../shared/sglang-cpu}
built_cache=$repo/.cache/sglang-kernel

python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip
"$pip" install -q torch==2.13.0
# sglang's metadata pins torch==2.14.1 and CUDA-only packages (flashinfer, cutlass, deep-gemm, tilelang): skip them.
"$pip" install -q --no-deps sglang==0.5.23
"$pip" install -q torch==2.13.0 -r "$here/sglang-deps-cpu.txt"
# sglang imports torchvision at start-up; the registries' torchvision 0.28.0 is a CUDA build whose operators do not
# load against torch+cpu, and its fake-op registration then raises "operator torchvision::nms does not exist".
"$pip" install -q --no-deps torchvision==0.28.0
meta=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchvision/_meta_registrations.py
sed -i 's|^@torch.library.register_fake("torchvision::\(q\?nms\)")|@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))|' "$meta"

kernel_wheel() {  # the kernel wheel in folder $1 (the last in name order), or nothing
  local found=""
  for path in "$1"/sglang_kernel_cpu-*-cp311-cp311-linux_x86_64.whl; do [ -e "$path" ] && found=$path; done
  echo "$found"
}

build_kernel() {  # build the kernel wheel from the source into $built_cache
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  if ! command -v g++ >/dev/null || [ ! -e /usr/include/numa.h ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends g++ libnuma-dev >/dev/null
  fi
  "$pip" install -q scikit-build-core wheel cmake ninja
  local src
  src=$(mktemp -d)
  tar -xzf "$here"/sgl-kernel-src-*.tar.gz -C "$src"
  mkdir -p "$built_cache"
  local start=$SECONDS
  # -ffile-prefix-map: no build path is embedded in the library.
  (cd "$src/sgl-kernel" && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CFLAGS="-ffile-prefix-map=$src=." \
    CXXFLAGS="-ffile-prefix-map=$src=." "$pip" wheel -q --no-build-isolation --no-deps -w "$built_cache" .)
  echo "install.sh: built the SGLang CPU kernel from source in $((SECONDS - start)) s" >&2
  rm -rf "$src"
}

wheel=""
if [ "$build" != "--build-kernel" ]; then
  wheel=$(kernel_wheel "$shared_cache")
  [ -n "$wheel" ] || wheel=$(kernel_wheel "$built_cache")
fi
if [ -z "$wheel" ]; then
  echo "install.sh: no prebuilt SGLang CPU kernel (in $shared_cache or $built_cache): building it from" \
    "$(basename "$here"/sgl-kernel-src-*.tar.gz)" >&2
  build_kernel
  wheel=$(kernel_wheel "$built_cache")
fi
echo "install.sh: SGLang CPU kernel from $wheel" >&2
"$pip" install -q --no-deps --force-reinstall "$wheel"
# The kernel is built for AVX-512: on a CPU without it (some AMD machines) importing it dies of SIGILL. The environment
# is still whole (the tests that need a server skip, saying why, and so do those that import the kernel); anything
# else that fails the check fails the install.
check=0
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c "import sgl_kernel; from sglang.srt.utils.common import cpu_has_amx_support as amx; print('sglang CPU environment ready; AMX:', amx())" || check=$?
if [ "$check" -ne 0 ]; then
  if [ "$check" -eq 132 ] && ! grep -qw avx512f /proc/cpuinfo; then
    echo "install.sh: sglang installed, but its CPU kernel cannot load on this CPU (no AVX-512: importing it dies of" \
      "SIGILL); the tests that need it skip, saying why" >&2
  else
    echo "install.sh: the SGLang environment's check failed (exit status $check)" >&2
    exit "$check"
  fi
fi
