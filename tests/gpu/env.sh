# Sourced by tests/gpu/check.sh on the GPU machine: installs the carried wheels into /tmp/site, unpacks the
# carried Debian packages into /tmp/debroot, and links only the shared libraries the machine lacks into
# /tmp/extra, so nothing of the image's own is replaced.
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
mkdir -p /tmp/debroot /tmp/extra
for f in .deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
export PATH=/tmp/debroot/usr/bin:$PATH
for _ in 1 2 3; do  # a library linked in may need others
  for bin in /tmp/site/mooncake/*.so /tmp/site/mooncake/mooncake_master /tmp/site/mooncake/mooncake_client \
             /tmp/site/rocksdict/*.so /tmp/debroot/usr/bin/redis-server /tmp/extra/*; do
    [ -e "$bin" ] && LD_LIBRARY_PATH=/tmp/extra ldd "$bin" 2>/dev/null | awk '/not found/{print $1}'
  done | sort -u | while read -r so; do
    f=$(find /tmp/debroot -name "$so" | head -1)
    if [ -n "$f" ]; then ln -sf "$f" "/tmp/extra/$so"; echo "linked $so"; else echo "MISSING $so"; fi
  done
done
export LD_LIBRARY_PATH=/tmp/extra
export PYTHONPATH=/tmp/site:$PWD/tests/gpu/vllm_stub:$PWD
export PYTHONUNBUFFERED=1
echo "set up in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
