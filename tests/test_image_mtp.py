"""MTP drafting over image prompts (issue 52, item 3): the head's cache takes each image row's
embedding paired with the target's hidden row before it, at the row's M-RoPE position (as
llama.cpp b11549's draft_mtp::process), and speculation stays lossless.

Models: the constructed-agreement tiny model (f32, n_embd 64, so ``write_mmproj``'s
projector fits it), whose head agrees with the target, so drafts are made and accepted
after the image and verify batches of several rows run at shifted positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggspec.config import SpecConfig
from pyggspec.sampling import SamplingParams
from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj

PROMPT = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
N = 24
SAMPLED = SamplingParams(temp=2.2, top_k=40, top_p=1.0, min_p=0.0, seed=7)


@pytest.fixture(scope="module")
def files(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("imgmtp")
    img = d / "wide.png"
    img.write_bytes(png_bytes(test_image_pixels(200, 70, seed=3)))  # nx != ny
    spec = models.spec("dense", dtype="f32", agreement=0.95, tied_embeddings=False)
    return {"model": models.path(spec), "mmproj": write_mmproj(d / "mmproj.gguf",
                                                                VisionSpec(), 64),
            "image": img}


def _engine(make_engine, files, spec_type, rollback="snapshot", **kw):
    return make_engine(files["model"], n_ctx=256, spec_type=spec_type, load_tokenizer=True,
                       spec=SpecConfig(rollback=rollback), mmproj=files["mmproj"],
                       mmproj_offload=False, **kw)


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
def test_spec_over_image_is_lossless(files, make_engine, rollback, sampling):
    outs = []
    for spec_type in (None, "draft-mtp"):
        e = _engine(make_engine, files, spec_type, rollback, n_ubatch=16, n_batch=16)
        r = e.generate(PROMPT, max_tokens=N, ignore_eos=True, images=[files["image"]],
                       sampling=sampling)
        outs.append(r.tokens)
        if spec_type:
            assert e.rollback == rollback
            assert r.spec.n_drafted > 0 and r.spec.n_accepted > 0.3 * r.spec.n_drafted
            # the cache got every prompt row's pair, image rows included
            assert e.worker.memory.mtp_length(0) >= len(r.prompt_tokens) - 1
    assert outs[0] == outs[1]


def test_moe_spec_over_image_is_lossless(models, files, make_engine):
    spec = models.spec("moe", dtype="f32", agreement=0.95, tied_embeddings=False)
    moe = {**files, "model": models.path(spec)}
    outs = []
    for spec_type in (None, "draft-mtp"):
        e = _engine(make_engine, moe, spec_type, n_ubatch=16, n_batch=16)
        r = e.generate(PROMPT, max_tokens=N, ignore_eos=True, images=[files["image"]])
        outs.append(r.tokens)
        if spec_type:
            assert r.spec.n_accepted > 0
    assert outs[0] == outs[1]


def test_parallel_image_and_text_speculate(files, make_engine):
    """-np 2: an image prompt and a text prompt speculate side by side (verify batches with
    a shifted and an unshifted sequence), each as without speculation."""
    text = "a text prompt of some length, here"
    outs = []
    for spec_type in (None, "draft-mtp"):
        e = _engine(make_engine, files, spec_type, n_parallel=2)
        g = e.generate_batch([PROMPT, text], max_tokens=N, ignore_eos=True,
                             images=[[files["image"]], None])
        outs.append([r.tokens for r in g])
        if spec_type:
            assert all(r.spec.n_accepted > 0 for r in g)
    assert outs[0] == outs[1]


def test_head_pairs_image_rows_with_the_previous_hidden(files, make_engine):
    """The MTP cache after an image prompt equals a cache written from first principles:
    one batch over the prompt where row q pairs the row's own input (token embedding, or
    the image row's projector embedding) with the target's post-norm hidden row q-1 (zero
    before the first), at llama.cpp's M-RoPE positions. Rows given as token 0 instead of
    the image write other K rows (the image reaches the head)."""
    from pyggspec.models.mtp import MtpBatch

    e = _engine(make_engine, files, "draft-mtp", n_ubatch=16, n_batch=16)
    e.generate(PROMPT, max_tokens=1, ignore_eos=True, images=[files["image"]])
    rows = e.image_rows(PROMPT, [files["image"]])
    n = len(rows.tokens)
    assert e.worker.memory.mtp_length(0) == n  # pairs (x_q, h_{q-1}), q = 0..n-1
    il = e.hp.n_layer
    got = _k_rows(e, il, n)
    # the reference: the target's hidden rows of the same prompt (one batch), then one
    # hand-made MTP batch into slot 0 of a fresh engine
    ref = _engine(make_engine, files, "draft-mtp", n_ubatch=256, n_batch=256)
    h = ref.decode({0: rows.tokens}, hidden=True, media={0: rows.media})[0].hidden
    pairs_h = np.concatenate([np.zeros((1, h.shape[1]), np.float32), h[:n - 1]])
    tokens = np.maximum(np.array(rows.tokens, np.int32), 0)[None]
    m = rows.media
    embd, mask = m.rows(0, n)[1], m.is_embd
    mb = MtpBatch(tokens, pairs_h[None], np.zeros(1, np.int64), (0,),
                  np.zeros(0, np.int32))
    mb.embd, mb.embd_rows = embd, mask.copy()
    mb.rope_pos = m.pos.copy()
    mb.rope_shift = np.zeros(1, np.int64)
    ref.mtp.media = None  # the batch says everything itself
    ref.mtp.run(mb)
    want = _k_rows(ref, il, n)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5), np.abs(got - want).max()
    # the same pairs without the image (token 0 at its rows) are other K rows
    ref.clear(0)
    mb.embd_rows = None
    mb.embd = None
    ref.mtp.run(mb)
    assert np.abs(_k_rows(ref, il, n) - got)[mask].max() > 1e-3


def _k_rows(engine, il: int, n: int) -> np.ndarray:
    """The MTP cache's K rows of slot 0, cells 0..n-1, as float32 [n, width]."""
    k = engine.mtp_kv.k(il)
    a = k.get().reshape(-1, k.ne[0])
    return a[np.arange(n) * engine.mtp_kv.n_slots].astype(np.float32)


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-mod,draft-mtp"])
def test_ngram_kinds_over_image_are_lossless(files, make_engine, spec_type):
    """The n-gram kinds read the committed ids, image rows' EMBD_ROW among them: a draft
    that would copy one is cut there, and the outputs are plain decoding's."""
    outs = []
    for st in (None, spec_type):
        e = _engine(make_engine, files, st, n_ubatch=16, n_batch=16)
        outs.append(e.generate(PROMPT, max_tokens=N, ignore_eos=True,
                               images=[files["image"]]).tokens)
    assert outs[0] == outs[1]
