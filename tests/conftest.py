"""Shared test fixtures.

Two sources of tiny GGUFs:

* ``pyggspec.testing`` (the project's fixture generator: ``write_model`` / ``write_split`` and
  the ``tiny_dense`` / ``tiny_moe`` presets) for the real fixture variants, when available;
* ``write_tiny`` below: a small, independent writer built on ``gguf.GGUFWriter`` whose knobs
  (drop / reshape / retype a tensor, change a metadata key) produce the malformed files the
  loader must reject. Its tensor list is written out by hand from REFERENCE.md §1.4-1.6 so it
  does not share code with the validator it tests.

Where things are:

* ``models`` (session): the generated models (``pyggspec.testing``), each spec written once per
  session into one temp dir -- ``models.dense(dtype=..., agreement=...)``, ``models.moe(...)``,
  ``models.get(arch, ...)``, ``models.split(arch, ...)``, ``models.path(spec, layout)``;
* ``make_engine`` (per test): ``make_engine(path, **kw)`` opens an Engine that is closed when
  the test ends, whatever happens in it (``with make_engine(...) as e:`` still closes early);
* ``shared_engine`` (session): one Engine per (path, kwargs) for the whole session, for tests
  that leave no state behind that another could see (closed at the end of the session);
* ``tiny`` / ``write_tiny``: the independent writer for malformed files (below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf  # a dependency of pyggspec: missing, it is an error, not a skip
import numpy as np
import pytest

from pyggspec.testing import ModelSpec, cached_model, tiny_dense, tiny_moe

_SENTINEL_DELETE = object()
DELETE = _SENTINEL_DELETE  # value for ``meta=`` that removes a key


def _tensor_list(a: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    E, V = a["n_embd"], a["n_vocab"]
    hd, nh, nkv = a["head_dim"], a["n_head"], a["n_head_kv"]
    S, G, H = a["d_state"], a["n_group"], a["dt_rank"]
    key_dim, value_dim = S * G, S * H
    conv_dim = 2 * key_dim + value_dim
    moe = a["arch"] == "qwen35moe"
    X, F, FS, FF = a["n_expert"], a["n_ff_exp"], a["n_ff_shexp"], a["n_ff"]
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (E, V)),
                                              ("output_norm.weight", (E,))]
    if not a["tied"]:
        out.append(("output.weight", (E, V)))

    def attn(p: str) -> None:
        out.extend([(p + "attn_q.weight", (E, 2 * nh * hd)), (p + "attn_k.weight", (E, nkv * hd)),
                    (p + "attn_v.weight", (E, nkv * hd)), (p + "attn_output.weight", (nh * hd, E)),
                    (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))])

    def ffn(p: str) -> None:
        if moe:
            out.extend([(p + "ffn_gate_inp.weight", (E, X)),
                        (p + "ffn_gate_exps.weight", (E, F, X)),
                        (p + "ffn_up_exps.weight", (E, F, X)),
                        (p + "ffn_down_exps.weight", (F, E, X)),
                        (p + "ffn_gate_inp_shexp.weight", (E,)),
                        (p + "ffn_gate_shexp.weight", (E, FS)), (p + "ffn_up_shexp.weight", (E, FS)),
                        (p + "ffn_down_shexp.weight", (FS, E))])
        else:
            out.extend([(p + "ffn_gate.weight", (E, FF)), (p + "ffn_up.weight", (E, FF)),
                        (p + "ffn_down.weight", (FF, E))])

    n = a["n_layer"]
    trunk = a["mtp"] != "only"
    for il in range(n if trunk else 0):
        p = f"blk.{il}."
        out.extend([(p + "attn_norm.weight", (E,)), (p + "post_attention_norm.weight", (E,))])
        if (il + 1) % a["interval"] == 0:
            attn(p)
        else:
            out.extend([(p + "attn_qkv.weight", (E, conv_dim)),
                        (p + "attn_gate.weight", (E, value_dim)),
                        (p + "ssm_conv1d.weight", (a["d_conv"], conv_dim)),
                        (p + "ssm_dt.bias", (H,)), (p + "ssm_a", (H,)),
                        (p + "ssm_beta.weight", (E, H)), (p + "ssm_alpha.weight", (E, H)),
                        (p + "ssm_norm.weight", (S,)), (p + "ssm_out.weight", (value_dim, E))])
        ffn(p)
    if a["mtp"] in ("grafted", "only"):
        p = f"blk.{n}."
        out.extend([(p + "attn_norm.weight", (E,)), (p + "post_attention_norm.weight", (E,))])
        attn(p)
        ffn(p)
        out.extend([(p + "nextn.eh_proj.weight", (2 * E, E)), (p + "nextn.enorm.weight", (E,)),
                    (p + "nextn.hnorm.weight", (E,)),
                    (p + "nextn.shared_head_norm.weight", (E,))])
    return out


def write_tiny(path: Path, *, arch: str = "qwen35", mtp: str = "grafted", dtype: str = "f32",
               n_embd: int = 64, n_layer: int = 4, n_vocab: int = 256, tied: bool = False,
               drop: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None,
               retype: dict[str, str] | None = None,
               extra: dict[str, tuple[int, ...]] | None = None,
               meta: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """Write a tiny qwen35/qwen35moe GGUF in the converter's layout, optionally damaged.

    ``mtp``: "grafted", "none" (no MTP block, nextn_predict_layers absent) or "only" (a
    sidecar: token_embd/output_norm/output + blk.N.*). ``meta`` entries replace metadata keys
    (``{arch}.`` is prefixed to keys starting with '.'); the value ``DELETE`` removes a key.
    """
    a = {"arch": arch, "mtp": mtp, "n_embd": n_embd, "n_layer": n_layer, "n_vocab": n_vocab, "tied": tied,
             "n_head": 4, "n_head_kv": 2, "head_dim": 32, "n_ff": 128, "d_conv": 4, "d_state": 16, "n_group": 2,
             "dt_rank": 4, "interval": 2, "n_expert": 8 if arch == "qwen35moe" else 0,
             "n_expert_used": 2 if arch == "qwen35moe" else 0, "n_ff_exp": 32, "n_ff_shexp": 64}
    n_mtp = 0 if mtp == "none" else 1
    keys: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layer + n_mtp,
        f"{arch}.feed_forward_length": a["n_ff"],
        f"{arch}.attention.head_count": a["n_head"],
        f"{arch}.attention.head_count_kv": a["n_head_kv"],
        f"{arch}.attention.key_length": a["head_dim"],
        f"{arch}.attention.value_length": a["head_dim"],
        f"{arch}.rope.dimension_count": 8,
        f"{arch}.rope.freq_base": 1e7,
        f"{arch}.rope.dimension_sections": [2, 1, 1, 0],
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.ssm.conv_kernel": a["d_conv"],
        f"{arch}.ssm.state_size": a["d_state"],
        f"{arch}.ssm.group_count": a["n_group"],
        f"{arch}.ssm.time_step_rank": a["dt_rank"],
        f"{arch}.ssm.inner_size": a["d_state"] * a["dt_rank"],
        f"{arch}.attention.recurrent_layers":
            [(i + 1) % 2 != 0 for i in range(n_layer)] + [False] * n_mtp,
        f"{arch}.full_attention_interval": 2,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(n_vocab - 2)] + ["<|im_start|>",
                                                                          "<|endoftext|>"],
        "tokenizer.ggml.token_type": [1] * (n_vocab - 2) + [3, 3],
        "tokenizer.ggml.merges": ["t 1", "t 2"],
        "tokenizer.ggml.eos_token_id": n_vocab - 1,
        "tokenizer.ggml.padding_token_id": n_vocab - 1,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
    }
    if n_mtp:
        keys[f"{arch}.nextn_predict_layers"] = 1
    if arch == "qwen35moe":
        keys[f"{arch}.expert_count"] = a["n_expert"]
        keys[f"{arch}.expert_used_count"] = a["n_expert_used"]
        keys[f"{arch}.expert_feed_forward_length"] = a["n_ff_exp"]
        keys[f"{arch}.expert_shared_feed_forward_length"] = a["n_ff_shexp"]
    for k, v in (meta or {}).items():
        k = f"{arch}{k}" if k.startswith(".") else k
        if v is DELETE:
            keys.pop(k, None)
        else:
            keys[k] = v

    w = gguf.GGUFWriter(str(path), arch=None)
    for k, v in keys.items():
        if k == "general.architecture":
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, list(v))

    rng = np.random.default_rng(seed)
    tensors = [t for t in _tensor_list(a) if t[0] not in drop]
    tensors += list((extra or {}).items())
    for name, ne in tensors:
        ne = (reshape or {}).get(name, ne)
        ttype = (retype or {}).get(name)
        if ttype is None:
            ttype = "f32" if len(ne) == 1 or "ssm_conv1d" in name or name.endswith("ssm_a") \
                else dtype
        data = rng.standard_normal(tuple(reversed(ne))).astype(np.float32) * 0.02
        if ttype == "f32":
            w.add_tensor(name, data)
        elif ttype == "f16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[ttype.upper()]
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny(name, **kw)``: a cached ``write_tiny`` file per name in this session; a name
    asked for again with other kwargs is an error (it would silently be the first file)."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, tuple[str, Path]] = {}

    def make(name: str, **kw: Any) -> Path:
        key = repr(sorted(kw.items()))
        if name not in cache:
            cache[name] = (key, write_tiny(root / f"{name}.gguf", **kw))
        elif cache[name][0] != key:
            raise ValueError(f"tiny({name!r}): already written with {cache[name][0]}, "
                             f"now asked with {key}")
        return cache[name][1]

    return make


PRESETS: dict[str, Callable[..., ModelSpec]] = {"dense": tiny_dense, "moe": tiny_moe}
# the engine factory's defaults: the machine's 2 cores, no tokenizer unless a test asks
ENGINE_DEFAULTS: dict[str, Any] = {"n_threads": 2, "load_tokenizer": False}


class Models:
    """The session's generated models: ``cached_model`` in one directory, so a spec asked
    for by several tests (or files) is written once.

    ``dense(**kw)`` / ``moe(**kw)`` / ``get(arch, **kw)``: the ``tiny_dense`` / ``tiny_moe``
    preset with ``kw`` as ``ModelSpec`` overrides (``dtype``, ``agreement``, ...), grafted MTP;
    ``split(arch, **kw)``: the same as (trunk, mtp-only sidecar); ``path(spec, layout)``: any
    spec (``layout="split"`` gives the pair).
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def spec(arch: str = "dense", **kw: Any) -> ModelSpec:
        return PRESETS[arch](**kw)

    def path(self, spec: ModelSpec, layout: str = "model") -> Any:
        return cached_model(spec, self.root, layout=layout)  # type: ignore[arg-type]

    def get(self, arch: str = "dense", **kw: Any) -> Path:
        return self.path(self.spec(arch, **kw))

    def dense(self, **kw: Any) -> Path:
        return self.get("dense", **kw)

    def moe(self, **kw: Any) -> Path:
        return self.get("moe", **kw)

    def split(self, arch: str = "dense", **kw: Any) -> tuple[Path, Path]:
        return self.path(self.spec(arch, **kw), layout="split")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The generated-model cache of this session (see :class:`Models`)."""
    return Models(tmp_path_factory.mktemp("models"))


def _open_engine(path: Any, kw: dict[str, Any]) -> Any:
    from pyggspec.engine import Engine

    if isinstance(path, tuple):  # (trunk, mtp) as Models.split gives them
        path, kw["mtp_path"] = path
    # the default configuration -- draft lengths by the draft-length rule -- unless a test
    # asks for fixed ones (adaptive=False: oracles that count drafts as llama.cpp makes them)
    return Engine(path, **{**ENGINE_DEFAULTS, **kw})


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Any]]:
    """``make_engine(path, **kw)``: an Engine (``ENGINE_DEFAULTS`` under ``kw``; ``path`` may
    be a (trunk, mtp) pair) closed when the test ends, also when it fails half-way."""
    opened: list[Any] = []

    def make(path: Any, **kw: Any) -> Any:
        e = _open_engine(path, kw)
        opened.append(e)
        return e

    yield make
    for e in reversed(opened):
        e.close()


@pytest.fixture(scope="session")
def shared_engine() -> Iterator[Callable[..., Any]]:
    """``shared_engine(path, **kw)``: one Engine per (path, kwargs) for the whole session,
    closed at its end. Only for tests that leave nothing behind another test could see
    (cleared sequences, no patched attributes), and never on the session's RPC device (its
    server may be gone before this closes)."""
    cache: dict[str, Any] = {}

    def get(path: Any, **kw: Any) -> Any:
        key = repr((path, sorted(kw.items())))
        if key not in cache:
            cache[key] = _open_engine(path, dict(kw))
        return cache[key]

    yield get
    for e in reversed(list(cache.values())):
        e.close()


@pytest.fixture(scope="session")
def testing_models(models: Models) -> dict[str, Path]:
    """The project generator's variants by name: ``{dense,moe}-{f32,f16,q8_0}``, ``-nomtp``
    and ``-split-trunk`` / ``-split-mtp`` (q8_0)."""
    out: dict[str, Path] = {}
    for arch in PRESETS:
        for dtype in ("f32", "f16", "q8_0"):
            out[f"{arch}-{dtype}"] = models.get(arch, dtype=dtype)
        out[f"{arch}-split-trunk"], out[f"{arch}-split-mtp"] = models.split(arch, dtype="q8_0")
        out[f"{arch}-nomtp"] = models.get(arch, mtp="none")
    return out


@pytest.fixture(scope="session")
def rpc_device():
    """A second real ggml device: an RPC server on loopback, alive for the whole session.

    ggml keeps a registered RPC device for the life of the process and llama.cpp aborts
    when it probes one whose server is gone, so every test shares this one server.
    """
    from pyggspec.ggml.device import RpcServer, add_rpc_server

    server = RpcServer(n_threads=1)
    try:
        (dev,) = add_rpc_server(server.endpoint)
        yield dev
    finally:
        server.close()


@pytest.fixture(scope="session")
def accel_device():
    """The GPU-API device (Vulkan, CUDA, Metal, ...) that tests/test_device.py runs on.

    ``PYGGSPEC_TEST_DEVICE=NAME`` picks one (e.g. ``Vulkan0``, ``CUDA0``); otherwise the first
    non-CPU, non-RPC device ggml lists. Without one the device tests skip, saying why --
    unless ``PYGGSPEC_REQUIRE_DEVICE=1`` (CI), where that is a failure: a claimed check
    never passes by skipping. Mesa's lavapipe is a CPU-type Vulkan device that ggml lists
    only when ``GGML_VK_VISIBLE_DEVICES`` names it (README, "Vulkan without a GPU").
    """
    import os

    from pyggspec.ggml.device import devices

    want = os.environ.get("PYGGSPEC_TEST_DEVICE", "").strip()
    found = [d for d in devices() if not d.is_cpu and not d.is_rpc]
    if want:
        found = [d for d in found if d.name.lower() == want.lower()]
    if not found:
        listed = ", ".join(d.name for d in devices())
        msg = (f"no {'device ' + want if want else 'GPU-API ggml device'} (ggml lists: {listed}); "
               "build with CMAKE_ARGS=-DGGML_VULKAN=on ./install.sh and, for lavapipe, set "
               "GGML_VK_VISIBLE_DEVICES=0")
        if os.environ.get("PYGGSPEC_REQUIRE_DEVICE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return found[0]
