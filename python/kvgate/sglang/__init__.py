"""kvgate as a transfer backend of SGLang's prefill/decode disaggregation (an optional extra:
`pip install 'kvgate[sglang]'`).

    python -m kvgate.sglang.launch_server --disaggregation-transfer-backend kvgate ...

runs SGLang's own launcher with the backend registered in every SGLang process (`register()`).
`conn` holds the KV manager, sender, receiver and bootstrap server (subclasses of SGLang's
`Common*` classes), `layout` how a request maps onto kvgate rooms and parts, `memory` how SGLang's
buffers become registered regions. See python/README.md, "SGLang backend".

Supported SGLang: `SUPPORTED_SGLANG` (the transfer-backend interface changes between releases).
"""

from __future__ import annotations

#: The SGLang releases the backend is written and tested against.
SUPPORTED_SGLANG = ("0.5.23",)
#: The `--disaggregation-transfer-backend` value.
BACKEND = "kvgate"


def register(*, shared_pools: bool | None = None) -> None:
    """Make `--disaggregation-transfer-backend kvgate` available in this SGLang process."""
    from .registry import register as _register

    _register(shared_pools=shared_pools)


__all__ = ["BACKEND", "SUPPORTED_SGLANG", "register"]
