"""kvfence's KV fence inside vLLM: a general plugin (entry point `vllm.general_plugins`: `kvfence`).

vLLM calls `register()` in each of its processes (VLLM_PLUGINS=kvfence selects it among others). It
refuses, in one line, a vLLM outside the supported versions or a malformed setting (settings.py), and
otherwise installs the hooks (patches.py).
"""

from __future__ import annotations

import os


def register() -> None:
    import vllm

    from kvfence_vllm.patches import install
    from kvfence_vllm.settings import PluginRefused, check_version, from_environ

    try:
        check_version(vllm.__version__)
        settings = from_environ(os.environ)
    except PluginRefused as refused:
        raise SystemExit(str(refused)) from None
    install(settings)
