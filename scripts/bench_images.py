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

Fresh servers minutes apart see the VM's drift (10-25%) as a difference between engines.
``--rounds N`` measures the image prefill alone on servers kept up, request by request in
rotating order, with the encoding timed apart (:func:`prefill_rounds`); ``--decode-rounds
N`` measures MTP's gain after an image against after text the same way
(:func:`decode_rounds`).

``--llama NAME=BUILD`` adds another llama-server build as engine NAME (e.g. b11549:
``PYGGSPEC_LLAMACPP_SRC=<xllamacpp sdist>/thirdparty/llama.cpp
PYGGSPEC_LLAMACPP_BUILD=.cache/llama.cpp-b11549-build scripts/build_llamacpp_tools.sh
llama-server``, then ``--llama b11549=.cache/llama.cpp-b11549-build``).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
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
    r = benchlib.post(base + "/completion", {**body, "prompt": p})
    first = time.perf_counter() - t0
    if n == 0:  # the prefill alone
        return {"first_s": first, "prompt_n": int(r["timings"]["prompt_n"])}
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


ENCODED = re.compile(r"image (?:slice )?encoded in (\d+(?:\.\d+)?) ms")
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")  # llama.cpp's log: min.s.ms.us


def encoding_s(lines: list[str]) -> float | None:
    """One request's image-encoding seconds from a server's log lines: the logged figure,
    or (llama-server 0.3.36, which logs none) the time from "encoding mtmd batch" to
    libmtmd's "decoding image batch 1/"."""
    got = [float(m.group(1)) / 1e3 for line in lines if (m := ENCODED.search(line))]
    if got:
        return sum(got)

    def at(line: str) -> float:
        m = STAMP.match(line)
        mi, se, ms, us = map(int, m.groups()) if m else (0, 0, 0, 0)
        return mi * 60 + se + ms / 1e3 + us / 1e6

    start = [at(x) for x in lines if "encoding mtmd batch" in x]
    end = [at(x) for x in lines if "decoding image batch 1/" in x]
    return end[0] - start[0] if start and end else None


def prefill_rounds(engines: list[str], model: Path, mmproj: Path, args, size: tuple[int, int],
                   prompt: str, text_prompt: str) -> dict[str, list[dict]]:
    """Image prefill alone, paired request by request: one plain server per engine up at
    once (the idle ones wait on a socket), then ``args.rounds`` rounds, each with an image
    no engine has seen, sent to one engine at a time in rotating order. A drift of the VM
    over minutes then falls on every engine alike, where fresh servers minutes apart see it
    as a difference. Each request's encoding time is read from the server's log (libmtmd's
    "image slice encoded in N ms"; ours logs "image encoded in N ms"); the rest of its wall
    time is the prompt's evaluation. After each, a text prompt of about the same length
    times the text model's prefill alone (where the engines' prompt evaluation differs
    without an image in it)."""
    servers = {}
    try:
        for e in engines:
            port = benchlib.free_port()
            base = f"http://127.0.0.1:{port}"
            cmd = serve_cmd(e, model, mmproj, port, args.threads, False)
            if e in LLAMA_BUILDS:
                cmd += ["-lv", "4"]  # libmtmd's lines, which time the encoding
            else:
                cmd[cmd.index("warning")] = "info"
            servers[e] = benchlib.ServerProcess(cmd, base, e)
            servers[e].start()
        out: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(-1, args.rounds):  # round -1 warms every engine up
            image = image_b64(*size, seed=100 + r)
            for e in engines[r % len(engines):] + engines[:r % len(engines)]:
                srv = servers[e]
                marker = props(srv.base).get("media_marker", "<__media__>")
                mark = srv.n_lines
                got = request(srv.base, prompt, image, 0, marker)
                time.sleep(0.2)  # the log line may trail the answer
                enc = encoding_s(srv.lines_since(mark))
                if enc is None:
                    raise RuntimeError(f"{e}: no encoding time in its log")
                text = request(srv.base, text_prompt, None, 0, marker)
                if r >= 0:
                    out[e].append({"wall_s": got["first_s"], "encode_s": enc,
                                   "prompt_n": got["prompt_n"], "text_s": text["first_s"],
                                   "text_n": text["prompt_n"]})
                    print(f"round {r + 1} {e}: {got['first_s']:.3f} s, encoding {enc:.3f} s"
                          f"; text prompt ({text['prompt_n']} tokens) {text['first_s']:.3f} s",
                          flush=True)
        return out
    finally:
        for srv in servers.values():
            srv.stop()


def decode_rounds(engines: list[str], model: Path, mmproj: Path, args, image: str,
                  prompts: dict[str, str]) -> dict[str, list[dict]]:
    """Decoding after an image against after text, paired request by request: a plain and
    an MTP server per engine up at once, two slots each (``id_slot`` 0 holds the image
    prompt, 1 the text one, both cached after the first round, so a request decodes and
    barely prefills), ``args.decode_rounds`` rounds of four requests per engine (plain and
    MTP, after the image and after text), one server at a time. Per round the quotient of
    MTP's gain after the image over its gain after text."""
    servers: dict[tuple[str, bool], benchlib.ServerProcess] = {}
    try:
        for e in engines:
            for spec in (False, True):
                port = benchlib.free_port()
                cmd = serve_cmd(e, model, mmproj, port, args.threads, spec)
                cmd[cmd.index("-np") + 1] = "2"
                srv = servers[e, spec] = benchlib.ServerProcess(
                    cmd, f"http://127.0.0.1:{port}", e)
                srv.start()
        out: dict[str, list[dict]] = {e: [] for e in engines}
        body = {"n_predict": args.n, "temperature": 0, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True}
        for r in range(-1, args.decode_rounds):  # round -1 fills the slots' caches
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            for e in order:
                got = {}
                for spec in ((False, True) if r % 2 else (True, False)):
                    srv = servers[e, spec]
                    marker = props(srv.base).get("media_marker", "<__media__>")
                    img = {"prompt_string": prompts["image"].replace("<__media__>", marker),
                           "multimodal_data": [image]}
                    for kind, prompt, slot in (("image", img, 0), ("text", prompts["text"], 1)):
                        res = benchlib.post(srv.base + "/completion",
                                            {**body, "prompt": prompt, "id_slot": slot})
                        key = ("mtp_" if spec else "plain_") + kind
                        got[key] = {"decode_tps": float(res["timings"]["predicted_per_second"]),
                                    "cache_n": int(res["timings"].get("cache_n", 0)),
                                    "tokens": res.get("tokens")}
                if r >= 0:
                    out[e].append(got)
                    gi = got["mtp_image"]["decode_tps"] / got["plain_image"]["decode_tps"]
                    gt = got["mtp_text"]["decode_tps"] / got["plain_text"]["decode_tps"]
                    print(f"round {r + 1} {e}: MTP / plain after the image {gi:.3f}, after "
                          f"text {gt:.3f}", flush=True)
        return out
    finally:
        for srv in servers.values():
            srv.stop()


def print_gains(runs: dict[str, list[dict]]) -> None:
    """Per engine: MTP's gain over plain decoding after the image and after text, their
    paired quotient, and whether MTP's tokens after the image are plain decoding's."""
    for e, rs in runs.items():
        gi = [r["mtp_image"]["decode_tps"] / r["plain_image"]["decode_tps"] for r in rs]
        gt = [r["mtp_text"]["decode_tps"] / r["plain_text"]["decode_tps"] for r in rs]
        same = all(r["mtp_image"]["tokens"] == r["plain_image"]["tokens"] for r in rs)
        print(f"{e}: MTP / plain after the image {med(gi)}, after text {med(gt)}; "
              f"(after the image) / (after text) {med([a / b for a, b in zip(gi, gt)])}; "
              f"MTP tokens = plain: {same}")


def props(base: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(base + "/props", timeout=30) as r:
        return json.loads(r.read())


med = benchlib.median_range


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
    ap.add_argument("--rounds", type=int, default=0,
                    help="measure image prefill alone: N rounds of paired requests to "
                         "servers kept up (see prefill_rounds)")
    ap.add_argument("--decode-rounds", type=int, default=0,
                    help="measure decoding after an image against after text alone: N "
                         "rounds on servers kept up (see decode_rounds)")
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
    if args.rounds:
        rounds = prefill_rounds(args.engines, model, mmproj, args, (w, h), prompts["image"],
                                prompts["text"])
        for other in (e for e in rounds if e != "ours" and "ours" in rounds):
            pairs = list(zip(rounds["ours"], rounds[other]))

            def ratio(f, pairs=pairs) -> str:
                return med([f(y) / f(x) for x, y in pairs])

            print(f"{other}'s time over ours: image prefill {ratio(lambda r: r['wall_s'])}; "
                  f"its encoding {ratio(lambda r: r['encode_s'])}, the rest (the prompt's "
                  f"evaluation) {ratio(lambda r: r['wall_s'] - r['encode_s'])}; a text "
                  f"prompt {ratio(lambda r: r['text_s'])}")
        benchlib.write_results(args, rounds=rounds)
        return
    if args.decode_rounds:
        rounds = decode_rounds(args.engines, model, mmproj, args, images[1], prompts)
        print_gains(rounds)
        benchlib.write_results(args, rounds=rounds)
        return
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
    print_gains(runs)
    for other in (e for e in runs if e != "ours" and "ours" in runs):
        pre = [b["plain_image"]["first_s"] / a["plain_image"]["first_s"]
               for a, b in zip(runs["ours"], runs[other])]
        print(f"image prefill speed, ours / {other} (its time over ours): {med(pre)}")
        same = all(a["plain_image"]["tokens"] == b["plain_image"]["tokens"]
                   for a, b in zip(runs["ours"], runs[other]))
        print(f"greedy tokens after the image equal to {other}'s: {same}")
    benchlib.write_results(args, llama_builds=LLAMA_BUILDS, runs=runs)


if __name__ == "__main__":
    main()
