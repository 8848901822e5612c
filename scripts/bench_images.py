#!/usr/bin/env python3
"""Images: ``pyggspec serve --mmproj`` vs ``llama-server --mmproj`` on the same files (issue 52).

The text model is the 0.8B-shaped constructed-agreement bench model; the projector is
generated at Qwen3.5's vision-tower size (``pyggspec.testing.hf_vision.VisionSpec`` with
the real depth 27, width 1152, 16 heads, MLP 4304, 48 x 48 positions: random weights of the
real layout, as llama.cpp's converter writes them). Each repetition starts one fresh server
at a time, in alternating order, and sends, with ``cache_prompt`` off:

* after a warm-up request with another image, an image request (``/completion`` ``{prompt_string, multimodal_data}``: text, the image,
  text; greedy, ``n`` tokens) -- image prefill (the request's wall time to its first
  token: encoding and the prompt's evaluation) and decode tokens/s after the image;
* the same request without the image (text of about the same length) -- decode tokens/s
  after text.

once with plain decoding and once with ``--spec-type draft-mtp``. Reported, paired per
repetition (median [min-max]): ours / llama-server image prefill, and for each engine MTP
decoding over plain after an image against the same after text.

    scripts/build_llamacpp_tools.sh llama-server    # once
    python3 scripts/bench_images.py --reps 5

``--llama NAME=BUILD`` adds another llama-server build as engine NAME (e.g. b11549:
``PYGGSPEC_LLAMACPP_SRC=<xllamacpp sdist>/thirdparty/llama.cpp
PYGGSPEC_LLAMACPP_BUILD=.cache/llama.cpp-b11549-build scripts/build_llamacpp_tools.sh
llama-server``, then ``--llama b11549=.cache/llama.cpp-b11549-build``).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import benchlib


def projector(text_hidden: int, depth: int) -> Path:
    """The generated projector at Qwen3.5's vision size (cached by its shape)."""
    from pyggspec.testing.hf_vision import VisionSpec, write_mmproj

    path = benchlib.CACHE / f"mmproj-qwen35-vision-d{depth}-{text_hidden}.gguf"
    if not path.exists():
        benchlib.CACHE.mkdir(parents=True, exist_ok=True)
        spec = VisionSpec(hidden_size=1152, depth=depth, num_heads=16, intermediate_size=4304,
                          num_position_embeddings=48 * 48)
        tmp = path.with_suffix(".tmp")
        write_mmproj(tmp, spec, text_hidden)
        tmp.rename(path)
    return path


def image_b64(w: int, h: int, seed: int = 7) -> str:
    from pyggspec.testing.hf_vision import png_bytes, test_image_pixels

    return base64.b64encode(png_bytes(test_image_pixels(w, h, seed=seed))).decode()


def request(base: str, prompt: str, image: str | None, n: int, marker: str) -> dict:
    """One greedy request; its wall time to the first token is measured with n_predict 1
    first (same prompt, no cache), then the whole request's timings."""
    body: dict = {"n_predict": 1, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                  "return_tokens": True}
    p = {"prompt_string": prompt.replace("<__media__>", marker),
         "multimodal_data": [image]} if image else prompt
    t0 = time.perf_counter()
    benchlib.post(base + "/completion", {**body, "prompt": p})
    first = time.perf_counter() - t0
    r = benchlib.post(base + "/completion", {**body, "prompt": p, "n_predict": n})
    return {"first_s": first, "decode_tps": float(r["timings"]["predicted_per_second"]),
            "prompt_n": int(r["timings"]["prompt_n"]), "tokens": r.get("tokens")}


LLAMA_BUILDS: dict[str, Path | None] = {"llama": None}  # engine name -> build (None: default)


def serve_cmd(engine: str, model: Path, mmproj: Path, port: int, threads: int,
              spec: bool) -> list[str]:
    flags = ["-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port",
             str(port), "-t", str(threads), "-c", "4096", "-np", "1"]
    if spec:
        flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    if engine in LLAMA_BUILDS:
        build = LLAMA_BUILDS[engine]
        return [str(benchlib.tool("llama-server", build and build / "bin")), *flags]
    return [sys.executable, "-m", "pyggspec", "serve", *flags, "--log-level", "warning"]


def run_engine(engine: str, model: Path, mmproj: Path, args, images: tuple[str, str],
               prompts) -> dict:
    """Plain and MTP servers in turn; each first answers a warm-up request with another
    image (llama-server warms up at start; an encoded image is never reused: ours keeps
    recent encodings, so the measured image is one it has not seen)."""
    warm, image = images
    out = {}
    for spec in (False, True):
        port = benchlib.free_port()
        base = f"http://127.0.0.1:{port}"
        srv = benchlib.ServerProcess(serve_cmd(engine, model, mmproj, port, args.threads,
                                               spec), base, engine)
        srv.start()
        try:
            marker = props(base).get("media_marker", "<__media__>")
            key = "mtp" if spec else "plain"
            request(base, prompts["image"], warm, 1, marker)
            out[key + "_image"] = request(base, prompts["image"], image, args.n, marker)
            out[key + "_text"] = request(base, prompts["text"], None, args.n, marker)
        finally:
            srv.stop()
    return out


def props(base: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(base + "/props", timeout=30) as r:
        return json.loads(r.read())


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agreement", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=128, help="tokens generated per request")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--image", default="448x448", help="WxH of the test image")
    ap.add_argument("--depth", type=int, default=27, help="vision-tower depth (27: Qwen3.5's)")
    ap.add_argument("--llama", action="append", default=[], metavar="NAME=BUILD",
                    help="another llama-server build folder, as engine NAME")
    ap.add_argument("--engines", nargs="+", default=None,
                    help="default: ours, llama and every --llama NAME")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    for spec in args.llama:
        name, _, build = spec.partition("=")
        LLAMA_BUILDS[name] = Path(build)
    args.engines = args.engines or ["ours", *LLAMA_BUILDS]

    from pyggspec.modelfile import open_model

    model = benchlib.generated_model(args.agreement, "q8_0")
    with open_model(model) as m:
        hidden = m.trunk.hparams.n_embd
    mmproj = projector(hidden, args.depth)
    w, h = map(int, args.image.split("x"))
    images = (image_b64(w, h, seed=8), image_b64(w, h))
    words = " ".join(f"w{i}" for i in range(40))
    prompts = {"image": f"Describe this: <__media__> {words}",
               "text": f"Describe this: {words} {words} {words} {words} {words}"}
    runs: dict[str, list[dict]] = {e: [] for e in args.engines}
    for rep in range(args.reps):
        for e in (args.engines if rep % 2 == 0 else args.engines[::-1]):
            runs[e].append(run_engine(e, model, mmproj, args, images, prompts))
            r = runs[e][-1]
            print(f"rep {rep + 1} {e}: image prefill {r['plain_image']['first_s']:.3f} s "
                  f"({r['plain_image']['prompt_n']} rows), decode plain/MTP after image "
                  f"{r['plain_image']['decode_tps']:.1f}/{r['mtp_image']['decode_tps']:.1f}, "
                  f"after text {r['plain_text']['decode_tps']:.1f}/"
                  f"{r['mtp_text']['decode_tps']:.1f} tokens/s", flush=True)
    print()
    for e, rs in runs.items():
        gain_img = [r["mtp_image"]["decode_tps"] / r["plain_image"]["decode_tps"] for r in rs]
        gain_txt = [r["mtp_text"]["decode_tps"] / r["plain_text"]["decode_tps"] for r in rs]
        same = all(r["mtp_image"]["tokens"] == r["plain_image"]["tokens"] for r in rs)
        print(f"{e}: MTP / plain after an image {med(gain_img)}, after text {med(gain_txt)}; "
              f"(after image) / (after text) {med([a / b for a, b in zip(gain_img, gain_txt)])}"
              f"; MTP tokens = plain tokens after the image: {same}")
    for other in (e for e in runs if e != "ours" and "ours" in runs):
        pre = [b["plain_image"]["first_s"] / a["plain_image"]["first_s"]
               for a, b in zip(runs["ours"], runs[other])]
        print(f"image prefill speed, ours / {other} (its time over ours): {med(pre)}")
        same = all(a["plain_image"]["tokens"] == b["plain_image"]["tokens"]
                   for a, b in zip(runs["ours"], runs[other]))
        print(f"greedy tokens after the image equal to {other}'s: {same}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"),
                                             "args": vars(args) | {"json_out": None},
                                             "llama_builds": {k: str(v) for k, v in
                                                              LLAMA_BUILDS.items()},
                                             "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
