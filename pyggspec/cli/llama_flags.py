"""llama.cpp's flags for ``pyggspec serve`` (llama-server) and ``pyggspec run`` (llama-cli /
llama-completion): every one has a status here, so none is "No such option".

The table covers every flag of llama.cpp b11549's ``common/arg.cpp`` in the server, cli and
completion examples (``tests/test_cli_llama_flags.py`` walks that file when it is there). Each
line is ``NAMES :: NARGS WHERE STATUS :: WHY``:

* NAMES: llama.cpp's spellings (one meaning; a switch's negative form gets its own line when
  its status differs);
* NARGS: the values it takes (0: a switch);
* WHERE: ``s`` serve, ``r`` run, ``sr`` both;
* STATUS: ``H`` honoured (a real option of the command, declared in ``run.py``/``serve.py``/
  ``common.py``), ``N`` accepted without effect (WHY says why that is llama.cpp's meaning
  here), ``R`` refused in one line (WHY says why); ``H/R``-style pairs give serve's then run's.
  ``N=a|b|c`` accepts only those values (case-insensitive) and refuses any other.

:func:`llama_flags` adds the ``N`` and ``R`` lines as options of a command (hidden, but for the
few everyday ones that say in ``-h`` what they do); an ``R`` flag, or an ``N`` flag with a value
it does not accept, stops the command with ``pyggspec: FLAG: not supported by pyggspec CMD
(WHY)`` and exit code 2. The other tool's flags are refused the same way (``-cb`` in ``run``:
"a llama-server flag"), so no llama.cpp spelling is split into a short flag and a value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"
_CODES = {"H": HONOURED, "N": NOOP, "R": REFUSED}

# the reasons shared by many lines
_THREADS = "pyggspec runs one ggml thread pool of -t threads, unpinned, at normal priority"
_DRAFT_PLACE = ("the MTP head runs with the trunk: on the output layer's device, with the "
                "trunk's threads and -ot patterns")
_MEDIA = ("not implemented: images come from a local projector file (-mm) and --image "
          "files, encoded on the projector's default device")
_MEDIA_NONE = "no projector is loaded without -mm"
_MEDIA_SERVE = "serve takes images per request (image_url parts), with -mm FILE"
_SAMPLER = "this sampler is not implemented (see --samplers for those that are)"
_GRAMMAR = "no server-wide grammar; per request: the grammar / json_schema fields"
_ROPE = "the context's RoPE comes from the GGUF; no overrides"
_DOWNLOAD = "pyggspec opens local GGUF files only (-m)"
_LORA = "adapters and control vectors are not implemented"
_NGRAM = "this n-gram kind is not implemented; --spec-type takes ngram-simple, ngram-mod, draft-mtp"
_PRESET = "llama.cpp's model presets download other models"
_INTERACTIVE = "pyggspec run is one-shot (no interactive mode)"
_ROUTER = "one model per server (no router mode)"
_LOG = "pyggspec logs to stderr; serve has --log-level"
_WEBUI = "pyggspec serve has no web UI"
_REASONING = ("run prints the text as generated: reasoning stays in it, as with "
              "--reasoning-format none")
_EMBED = "pyggspec serve generates text only, no embeddings or reranking"
_TEMPLATE_RUN = "pyggspec run renders the GGUF's own template with -cnv; serve has the options"
_TF = "on|off|auto|enabled|disabled|true|false|1|0"

TABLE = f"""
-h --help :: 0 sr H
--usage :: 0 sr R :: use -h
--version :: 0 sr R :: use pyggspec --version
-cl --cache-list :: 0 sr R :: {_DOWNLOAD}
--completion-bash :: 0 sr R :: no completion script
--server-base :: 1 r R :: pyggspec run runs its own engine
--verbose-prompt :: 0 r R :: not implemented
--display-prompt --no-display-prompt :: 0 r R :: the prompt is never echoed
-co --color :: 1 r N=off|auto|0|false|disabled :: output is never coloured
-t --threads :: 1 sr H
-tb --threads-batch :: 1 sr N :: one thread count, -t, serves prompt processing and generation
-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll :: 1 sr N :: {_THREADS}
-Cb --cpu-mask-batch -Crb --cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch :: 1 sr N :: {_THREADS}
-lcs --lookup-cache-static -lcd --lookup-cache-dynamic :: 1 s R :: {_NGRAM}
-c --ctx-size :: 1 sr H
--kv-unified-per-slot :: 1 s R :: each slot holds its own -c tokens: pyggspec's -c is per slot
-n --predict --n-predict :: 1 sr H
-b --batch-size :: 1 sr H
-ub --ubatch-size :: 1 sr H
--keep :: 1 sr R :: no context shift, so nothing to keep
--swa-full :: 0 sr N :: Qwen3.5 has no sliding-window layers
-ctxcp --ctx-checkpoints --swa-checkpoints :: 1 sr H
-cms :: 1 s H
--checkpoint-min-step :: 1 sr H
-cram --cache-ram :: 1 sr N :: prompt reuse keeps -ctxcp recurrent-state checkpoints per slot, not a host prompt cache
-kvu --kv-unified -no-kvu --no-kv-unified :: 0 s H
--cache-idle-slots --no-cache-idle-slots :: 0 s N :: an idle slot keeps its tokens for prompt reuse
--context-shift :: 0 sr R :: no context shift: generation stops when the context is full
--no-context-shift :: 0 sr N :: there is no context shift: generation stops when the context is full
-fa --flash-attn :: 1 sr N={_TF} :: pyggspec's graphs choose their own attention kernels
-p --prompt :: 1 r H
-sys --system-prompt :: 1 r H
--perf --no-perf :: 0 sr N :: timings are always measured
--show-timings --no-show-timings :: 0 r N :: run prints its timings to stderr, or in the --json object
-f --file :: 1 r H
-sysf --system-prompt-file :: 1 r R :: use -sys
-bf --binary-file :: 1 r R :: use -f or --prompt-tokens
-e --escape :: 0 sr R :: prompts are taken literally, no escape processing
--no-escape :: 0 sr N :: prompts are taken literally
-ptc --print-token-count :: 1 r R :: {_INTERACTIVE}
--prompt-cache --prompt-cache-all --prompt-cache-ro :: 1 r R :: no prompt cache files
-r --reverse-prompt :: 1 sr R :: stop strings are per request, the "stop" field; run has none
-sp --special :: 0 sr R :: special tokens are never rendered in the output text
-cnv --conversation :: 0 r H
-no-cnv --no-conversation :: 0 r N :: run is not a conversation unless -cnv
-st --single-turn :: 0 r N :: run is always one turn
-i --interactive -if --interactive-first -mli --multiline-input --in-prefix-bos :: 0 r R :: {_INTERACTIVE}
--in-prefix --in-suffix :: 1 r R :: {_INTERACTIVE}
--warmup --no-warmup :: 0 sr N :: no warm-up run; graphs are sized when the engine is built
--spm-infill :: 0 s H
--samplers -s --seed --temp --temperature --top-k --top-p --min-p --typical --typical-p :: 1 sr H
--repeat-last-n --repeat-penalty --presence-penalty --frequency-penalty -l --logit-bias :: 1 sr H
--ignore-eos :: 0 s/r R/H :: server-wide it is not implemented; per request: the ignore_eos field
--sampler-seq --sampling-seq :: 1 sr R :: use --samplers, names separated by ';'
--top-nsigma --top-n-sigma --xtc-probability --xtc-threshold :: 1 sr R :: {_SAMPLER}
--dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker :: 1 sr R :: {_SAMPLER}
--adaptive-target --adaptive-decay --dynatemp-range --dynatemp-exp :: 1 sr R :: {_SAMPLER}
--mirostat --mirostat-lr --mirostat-ent :: 1 sr R :: {_SAMPLER}
--grammar --grammar-file -j --json-schema -jf --json-schema-file :: 1 s/r R/H :: {_GRAMMAR}
-bs --backend-sampling :: 0 sr H
--pooling :: 1 s R :: {_EMBED}
--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx :: 1 sr R :: {_ROPE}
--yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast :: 1 sr R :: {_ROPE}
-gan --grp-attn-n -gaw --grp-attn-w :: 1 r R :: {_ROPE}
-kvo --kv-offload :: 0 sr N :: the KV cache lives with its layers, as llama.cpp's default
-nkvo --no-kv-offload :: 0 sr R :: the KV cache always lives with its layers' device
--repack :: 0 sr N :: CPU weights are repacked by default
-nr --no-repack :: 0 sr H
--no-host :: 0 sr N :: host buffers are chosen by the placement
-ctk --cache-type-k -ctv --cache-type-v :: 1 sr H
-dt --defrag-thold :: 1 sr N :: deprecated in llama.cpp; the cache needs no defragmentation
-np --parallel :: 1 sr H
-cb --cont-batching :: 0 s N :: continuous batching is always on
-nocb --no-cont-batching :: 0 s R :: continuous batching is always on
-mm --mmproj :: 1 sr H
--image :: 1 s/r R/H :: {_MEDIA_SERVE}
-mmu --mmproj-url -mmdev --mmproj-device --audio --video :: 1 sr R :: {_MEDIA}
--image-min-tokens --image-max-tokens :: 1 sr H
--mtmd-batch-max-tokens --video-fps :: 1 sr R :: {_MEDIA}
--video-timestamp-interval --video-ffmpeg-dir :: 1 sr R :: {_MEDIA}
--mmproj-auto --mmproj-offload :: 0 sr R :: {_MEDIA}
--no-mmproj --no-mmproj-auto :: 0 sr N :: {_MEDIA_NONE}
--no-mmproj-offload :: 0 sr H
--rpc :: 1 sr H
-lm --load-mode :: 1 sr N=mmap :: weights are mapped unless --no-mmap; mlock and direct I/O are not implemented
-lzm --lazy-mode :: 1 sr R :: weights are loaded when the engine is built
--numa :: 1 sr R :: no NUMA placement
-dev --device :: 1 sr H
--list-devices :: 0 sr R :: use pyggspec devices
-ot --override-tensor :: 1 sr H
-cmoe --cpu-moe :: 0 sr H
-ncmoe --n-cpu-moe :: 1 sr H
--moe-cache-mib :: 1 sr R :: no MoE expert cache
-ncffn --n-cpu-ffn :: 1 sr R :: use -ot 'blk\\.N\\.ffn=CPU'
-ngl --gpu-layers --n-gpu-layers :: 1 sr H
-sm --split-mode :: 1 sr N=layer :: layers are split across -dev devices, llama.cpp's layer mode
-ts --tensor-split -mg --main-gpu :: 1 sr R :: use -dev and -ot to place layers
-fit --fit -fitt --fit-target -fitc --fit-ctx :: 1 sr H
--check-tensors :: 0 sr N :: tensor layouts and sizes are always checked on load
--override-kv :: 1 sr R :: GGUF metadata is used as stored
--op-offload --no-op-offload :: 0 sr N :: ggml's scheduler decides where host-weight ops run
--lora --lora-scaled --control-vector --control-vector-scaled :: 1 sr R :: {_LORA}
--control-vector-layer-range :: 2 sr R :: {_LORA}
--lora-init-without-apply :: 0 s R :: {_LORA}
-a --alias :: 1 s H
--tags :: 1 s H
-m --model :: 1 sr H
-mu --model-url -dr --docker-repo -hf -hfr --hf-repo -hff --hf-file -hft --hf-token :: 1 sr R :: {_DOWNLOAD}
-o --output --output-file :: 1 r R :: output goes to stdout; --json prints one object
--embd-normalize :: 1 s R :: {_EMBED}
--host --port --api-key :: 1 s H
--reuse-port :: 0 s R :: not implemented
--path :: 1 s R :: {_WEBUI}
--cors-origins --cors-methods --cors-headers :: 1 s H
--cors-credentials --no-cors-credentials :: 0 s H
--api-prefix :: 1 s R :: endpoints are served at the root
--ui-config --webui-config --ui-config-file --webui-config-file :: 1 s R :: {_WEBUI}
--ui --webui --ui-mcp-proxy --webui-mcp-proxy :: 0 s R :: {_WEBUI}
--no-ui --no-webui --no-ui-mcp-proxy --no-webui-mcp-proxy :: 0 s N :: {_WEBUI}
--tools --tools-runtime --mcp-servers-config --mcp-servers-json :: 1 s R :: no built-in server tools (a request's own tools work)
-ag --agent :: 0 s R :: no built-in server tools (a request's own tools work)
-no-ag --no-agent :: 0 s N :: no built-in server tools
--embedding --embeddings --rerank --reranking :: 0 s R :: {_EMBED}
--api-key-file :: 1 s H
--ssl-key-file --ssl-cert-file :: 1 s R :: no TLS; put a reverse proxy in front
--chat-template-kwargs :: 1 s/r H/R :: run renders the GGUF's template as is
-to --timeout --sse-ping-interval :: 1 s N :: uvicorn's defaults hold connections
--threads-http :: 1 s N :: one asyncio event loop serves HTTP
--cache-prompt :: 0 s N :: prompt reuse is always on; per request: cache_prompt
--no-cache-prompt :: 0 s R :: prompt reuse cannot be turned off server-wide; per request: cache_prompt false
--cache-reuse :: 1 s R :: no KV shifting for chunk reuse
--metrics :: 0 s H
--props :: 0 s R :: POST /props is not implemented; GET /props is served
--slots --no-slots :: 0 s H
--slot-save-path :: 1 s H
--media-path :: 1 s H
--models-dir --models-preset --models-max :: 1 s R :: {_ROUTER}
--models-autoload --no-models-autoload :: 0 s R :: {_ROUTER}
--jinja --no-jinja :: 0 s/r H/R :: {_TEMPLATE_RUN}
--reasoning-format :: 1 s/r H/N=none :: {_REASONING}
-rea --reasoning :: 1 s/r H/N=auto :: the template's default decides
--reasoning-effort :: 1 s/r H/N=default :: the template's default decides
--reasoning-budget :: 1 s/r H/N=-1 :: no thinking budget
--reasoning-budget-message :: 1 s/r H/R :: no thinking budget
--reasoning-preserve --no-reasoning-preserve :: 0 sr R :: the chat template's own rule decides which turns keep their reasoning
--chat-template :: 1 s/r H/R :: {_TEMPLATE_RUN}
--chat-template-file :: 1 s/r H/R :: {_TEMPLATE_RUN}
--skip-chat-parsing --no-skip-chat-parsing :: 0 s/r H/N :: run's output is never parsed
--prefill-assistant --no-prefill-assistant :: 0 s H
-sps --slot-prompt-similarity :: 1 s N :: a request takes the slot with the longest reusable prefix
--sleep-idle-seconds :: 1 s R :: the model stays loaded
--simple-io :: 0 r N :: run's output is plain already
--log-disable --log-jsonl --no-log-jsonl :: 0 sr N :: {_LOG}
-v --verbose --log-verbose :: 0 s/r H/N :: {_LOG}
--log-prefix --no-log-prefix --log-timestamps --no-log-timestamps :: 0 sr N :: {_LOG}
--log-file --log-prompts-dir :: 1 sr R :: {_LOG}
--log-colors -lv --verbosity --log-verbosity :: 1 sr N :: {_LOG}
--offline :: 0 sr N :: pyggspec never downloads anything
--spec-draft-hf -hfd -hfrd --hf-repo-draft :: 1 sr R :: {_DOWNLOAD}
--spec-draft-threads -td --threads-draft --spec-draft-threads-batch -tbd --threads-batch-draft :: 1 sr N :: {_DRAFT_PLACE}
--spec-draft-cpu-mask -Cd --cpu-mask-draft --spec-draft-cpu-range -Crd --cpu-range-draft :: 1 sr N :: {_THREADS}
--spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio --prio-draft :: 1 sr N :: {_THREADS}
--spec-draft-poll --poll-draft --spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft :: 1 sr N :: {_THREADS}
--spec-draft-cpu-strict-batch --cpu-strict-batch-draft --spec-draft-prio-batch --prio-batch-draft :: 1 sr N :: {_THREADS}
--spec-draft-poll-batch --poll-batch-draft :: 1 sr N :: {_THREADS}
--spec-draft-type-k -ctkd --cache-type-k-draft --spec-draft-type-v -ctvd --cache-type-v-draft :: 1 sr H
--spec-draft-override-tensor -otd --override-tensor-draft :: 1 sr R :: {_DRAFT_PLACE}
--spec-draft-cpu-moe -cmoed --cpu-moe-draft :: 0 sr R :: {_DRAFT_PLACE}
--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft :: 1 sr R :: {_DRAFT_PLACE}
--spec-draft-device -devd --device-draft :: 1 sr R :: {_DRAFT_PLACE}
--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft :: 1 sr N :: {_DRAFT_PLACE}
--spec-draft-n-max --spec-draft-n-min --spec-draft-p-min --draft-p-min :: 1 sr H
--spec-draft-sampling --spec-draft-model -md --model-draft --spec-type :: 1 sr H
--spec-draft-backend-sampling --no-spec-draft-backend-sampling :: 0 sr H
--spec-synth-len --spec-synth-rates :: 1 sr R :: synthetic drafts are not implemented
--spec-draft-p-split --draft-p-split :: 1 sr R :: one draft chain per sequence, no tree splits
--spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-mod-n-match :: 1 sr H
--spec-ngram-simple-size-n --spec-ngram-simple-size-m --spec-ngram-simple-min-hits :: 1 sr H
--spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits :: 1 sr R :: {_NGRAM}
--spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits :: 1 sr R :: {_NGRAM}
--spec-ngram-size-n --spec-ngram-size-m --spec-ngram-min-hits :: 1 s R :: removed in llama.cpp: use the respective --spec-ngram-simple-* or --spec-ngram-mod-n-match
--draft --draft-n --draft-max :: 1 sr R :: removed in llama.cpp: use --spec-draft-n-max
--draft-min --draft-n-min :: 1 sr R :: removed in llama.cpp: use --spec-draft-n-min
--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default :: 0 s R :: {_PRESET}
--fim-qwen-7b-default --fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default :: 0 s R :: {_PRESET}
--gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default :: 0 sr R :: {_PRESET}
--vision-gemma-12b-default --spec-default :: 0 sr R :: {_PRESET}
"""

# no-op flags shown in -h (the everyday ones); every other N and R flag is hidden
VISIBLE = frozenset({"-fa", "-cb", "--offline", "-cram",
                     "--no-context-shift", "--swa-full", "-tb", "--no-webui", "-ngld"})


@dataclass(frozen=True)
class LlamaFlag:
    """One line of :data:`TABLE`."""

    names: tuple[str, ...]
    nargs: int
    status: Mapping[str, str]  # "serve" | "run" -> HONOURED | NOOP | REFUSED
    accept: tuple[str, ...] | None  # values an N flag takes (None: any)
    why: str


def _parse(table: str) -> tuple[LlamaFlag, ...]:
    out = []
    for line in table.strip().splitlines():
        names, spec, *why = (p.strip() for p in line.split("::"))
        nargs, where, status = spec.split()
        status, _, accept = status.partition("=")
        wheres, statuses = where.split("/"), status.split("/")
        if len(wheres) == 1:
            wheres, statuses = list(where), statuses * len(where)
        cmds = {"s": "serve", "r": "run"}
        out.append(LlamaFlag(tuple(names.split()), int(nargs),
                             {cmds[w]: _CODES[s] for w, s in zip(wheres, statuses)},
                             tuple(accept.split("|")) if accept else None,
                             why[0] if why else ""))
    return tuple(out)


FLAGS: tuple[LlamaFlag, ...] = _parse(TABLE)


def status_of(command: str) -> dict[str, LlamaFlag]:
    """Every llama.cpp flag name of ``command``'s llama.cpp tool -> its line."""
    return {n: f for f in FLAGS if command in f.status for n in f.names}


def counts() -> dict[str, dict[str, int]]:
    """Flag names per status, per command."""
    out: dict[str, dict[str, int]] = {}
    for cmd in ("serve", "run"):
        c = {HONOURED: 0, NOOP: 0, REFUSED: 0}
        for f in status_of(cmd).values():
            c[f.status[cmd]] += 1
        out[cmd] = c
    return out


class FlagRefused(click.ClickException):
    """A llama.cpp flag pyggspec does not support: one line, exit code 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"pyggspec: {self.message}", err=True)


def _used_spelling(ctx: click.Context, param: click.Parameter) -> str:
    raw = ctx.meta.get("pyggspec.raw_args", ())
    for a in raw:
        name = a.split("=", 1)[0]
        if name in param.opts:
            return name
    return param.opts[0]


# the other llama.cpp tool's flags, refused by each command (so -cb in run is not '-c b')
_OTHER = {"serve": ("run", "a llama-cli flag; see pyggspec run"),
          "run": ("serve", "a llama-server flag; see pyggspec serve")}


def _foreign(command: str) -> tuple[LlamaFlag, ...]:
    """The flags of the other command's llama.cpp tool that ``command``'s tool lacks, as
    refusals."""
    other, why = _OTHER[command]
    own = set(status_of(command))
    out = []
    for f in FLAGS:
        if command not in f.status and other in f.status:
            names = tuple(n for n in f.names if n not in own)
            if names:
                out.append(LlamaFlag(names, f.nargs, {command: REFUSED}, None, why))
    return tuple(out)


def _callback(command: str, flag: LlamaFlag) -> Callable[..., None]:
    def check(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or value is False:  # not given (the defaults)
            return
        if isinstance(value, tuple) and len(value) == 1:
            value = value[0]
        spelled = _used_spelling(ctx, param)
        if flag.status[command] == REFUSED:
            raise FlagRefused(f"{spelled}: not supported by pyggspec {command} ({flag.why})")
        if flag.accept is not None:
            v = str(value).lower()
            if v not in flag.accept:
                raise FlagRefused(f"{spelled} {value}: not supported by pyggspec {command} "
                                  f"({flag.why}; accepted: {', '.join(flag.accept)})")
    return check


def _option(command: str, i: int, flag: LlamaFlag) -> Callable[[F], F]:
    visible = flag.status[command] == NOOP and VISIBLE & set(flag.names)
    attrs: dict[str, Any] = {"expose_value": False, "hidden": not visible,
                             "callback": _callback(command, flag)}
    if flag.nargs == 0:
        attrs.update(is_flag=True, default=False)
    else:
        attrs.update(nargs=flag.nargs, default=None, metavar=(
            "|".join(flag.accept) if flag.accept else "X"))
    if visible:
        attrs["help"] = f"Accepted for llama.cpp; no effect: {flag.why}."
    return click.option(*flag.names, f"llama_flag_{i}", **attrs)


class LlamaCommand(click.Command):
    """A click command that remembers its raw arguments (to name the spelling a user gave)
    and reads a long flag's underscores as dashes, as llama.cpp's parser does
    (``--backend_sampling`` is ``--backend-sampling``; values are left as given)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = [_dashes(a) for a in args]
        ctx.meta["pyggspec.raw_args"] = tuple(args)
        return super().parse_args(ctx, args)


def _dashes(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def llama_flags(command: str) -> Callable[[F], F]:
    """Add ``command``'s llama.cpp flags that are accepted without effect or refused."""

    def deco(fn: F) -> F:
        for i, flag in reversed(list(enumerate(FLAGS + _foreign(command)))):
            if flag.status.get(command) in (NOOP, REFUSED):
                fn = _option(command, i, flag)(fn)
        return fn

    return deco


__all__ = ["FLAGS", "HONOURED", "NOOP", "REFUSED", "FlagRefused", "LlamaCommand", "LlamaFlag",
           "counts", "llama_flags", "status_of"]
