#!/usr/bin/env bash
# A virtualenv layered over vLLM's (install-vllm-cpu.sh's) with this checkout's kvfence and kvfence-vllm
# installed editable, and a serve-vllm.sh that runs vLLM from it. The plugin loads in every vLLM process
# started from this environment only: vLLM's own environment, which other runs use (bench/vs_vllm.py)
# as plain vLLM, is left untouched. Seconds once made; re-made when it points at another checkout.
# Usage: plugins/vllm/overlay-env.sh VLLM_DIR OVERLAY_DIR   (run from the checkout's root)
set -euo pipefail
base=$(cd "$1" && pwd); overlay=$2; root=$(pwd)
site=$("$base/venv/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
probe='import kvfence, kvfence_vllm; print(kvfence.__path__[0], kvfence_vllm.__path__[0])'
want="$root/kvfence $root/plugins/vllm/kvfence_vllm"
if [ "$(cd / && "$overlay/bin/python" -c "$probe" 2>/dev/null)" != "$want" ]; then
  rm -rf "$overlay"
  python3 -m venv "$overlay"
  over=$("$overlay/bin/python" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$over/vllm-base.pth"  # vLLM and its torch, after this environment's own packages
  "$overlay/bin/pip" install --quiet --no-deps -e "$root" -e "$root/plugins/vllm" >&2
fi
sed "s#$base/venv/bin/python#$overlay/bin/python#" "$base/serve-vllm.sh" > "$overlay/serve-vllm.sh"
chmod +x "$overlay/serve-vllm.sh"
echo "$overlay/serve-vllm.sh"
