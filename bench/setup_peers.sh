#!/usr/bin/env bash
# Builds the peers that bench/compare.py runs beside leanserve, once, under bench/.peers/
# (git-ignored), and adds matplotlib (the `bench` extra) to .venv for the plot. Everything
# comes from PyPI, pinned, and is compiled here for this CPU:
#   - llama-cpp-python[server]==$LLAMA_CPP_PYTHON in its own venv (its OpenAI server runs one
#     request at a time: it has no parallel slots);
#   - llama.cpp's own `llama-server` (parallel slots, continuous batching), built from the
#     llama.cpp sources vendored in that same sdist, so both peers are the same llama.cpp.
# Takes ~10 minutes on 2 cores the first time; later runs return at once.
set -euo pipefail
LLAMA_CPP_PYTHON=0.3.36
root="$(cd "$(dirname "$0")" && pwd)/.peers"
venv="$root/venv-llamacpp"
mkdir -p "$root"

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q scikit-build-core
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON"
fi

if [ ! -x "$root/llama-server" ]; then
    src="$root/src"
    rm -rf "$src" && mkdir -p "$src"
    "$venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$src"
    tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
    llama="$(echo "$src"/llama_cpp_python-*/vendor/llama.cpp)"
    cmake -S "$llama" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DBUILD_SHARED_LIBS=OFF > "$src/cmake.log"
    cmake --build "$src/build" --target llama-server -j "$(nproc)" > "$src/build.log"
    cp "$src/build/bin/llama-server" "$root/llama-server"
    rm -rf "$src"
fi
# compare.py's plot.
"$(dirname "$0")/../.venv/bin/python" -m pip install -q -e "$(dirname "$0")/..[bench]"
echo "peers ready in $root"
