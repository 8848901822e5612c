"""``python -m pyggspec.ggml.rpc_server HOST:PORT [THREADS]``: serve this CPU over ggml RPC.

Equivalent in purpose to llama.cpp's ``rpc-server``; blocks until killed.
"""

from __future__ import annotations

import sys

from pyggspec.errors import PyggspecError


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m pyggspec.ggml.rpc_server HOST:PORT [THREADS]", file=sys.stderr)
        return 2
    endpoint = argv[0]
    threads = int(argv[1]) if len(argv) > 1 else 1
    try:
        from pyggspec.ggml import _lib

        rc = _lib.lib.pyggspec_rpc_start_server(endpoint.encode(), _lib.ffi.NULL, threads)
    except PyggspecError as e:
        print(e, file=sys.stderr)
        return 1
    if rc == -1:
        print(f"pyggspec: {endpoint}: llama-cpp-python was built without the RPC backend",
              file=sys.stderr)
        return 1
    if rc != 0:
        print(f"pyggspec: {endpoint}: RPC server failed ({rc})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
