#!/bin/bash
# Gather what a GPU machine without network needs to run tests/gpu/check.sh, into .whl/ and .deb/ (git-ignored):
# such a machine (this project's device machines: CUDA, torch, pytest, Python 3.12) has no vLLM, no
# redis-server and none of the store's own Python packages. Wheels are pinned to the versions in .venv.
# Run from the repository root on a machine with network and `make setup` done:  bash tests/gpu/fetch_packages.sh
set -euo pipefail
python_version=${GPU_PYTHON_VERSION:-3.12}
names="redis hiredis pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection fastapi
       starlette uvicorn pyzmq msgspec mooncake-transfer-engine-non-cuda rocksdict"
pattern=$(echo $names | sed 's/[-_]/[-_]/g; s/ /|/g')
pins=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE "^($pattern)==")
mkdir -p .whl .deb
platforms=""
for tag in 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do platforms+=" --platform manylinux_${tag}_x86_64"; done
# shellcheck disable=SC2086 # word splitting intended
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp $platforms --platform manylinux2014_x86_64 -d .whl $pins
# redis-server, and the shared libraries Mooncake's binaries link that a CUDA image may lack
(cd .deb && apt-get download redis-server redis-tools libjemalloc2 liblzf1 libibverbs1 librdmacm1 libnl-3-200 \
    libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libldap-2.5-0 libbrotli1 libsasl2-2)
du -sh .whl .deb
