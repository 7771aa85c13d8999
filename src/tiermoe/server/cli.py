"""`tiermoe serve [MODEL]`: the OpenAI/Anthropic-compatible HTTP server (vllm serve flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
from pathlib import Path

from tiermoe import env
from tiermoe.engine.build import add_routing_args, add_sizing_args, add_store_args, check_sizing_args
from tiermoe.engine.threads import add_cpu_threads_arg, serving_threads, use_cpu_threads
from tiermoe.errors import UserError
from tiermoe.model_source import check_name, is_repo_id, resolve_model
from tiermoe.server.access_log import REQUESTS_LOGGER, STATS_LOGGER
from tiermoe.server.sampling_defaults import MODES as SAMPLING_MODES
from tiermoe.server.sampling_defaults import SamplingDefaults, load_sampling_defaults

log = logging.getLogger("tiermoe.server")


def _limits_epilog() -> str:
    from tiermoe.server.limits import (MAX_PATTERN_CHARS, MAX_SCHEMA_DEPTH, MAX_SCHEMA_VALUES, MAX_STOP_CHARS,
                                       MAX_STOP_STRINGS)

    return f"""limits on requests (fixed unless a flag above changes them):
  body           --max-body-mb (413 beyond); headers: only a header block still incomplete past
                 16 KiB is refused (the connection is closed, no response); a larger block that
                 arrives in one read is taken
  JSON nesting   about 200 levels in a body (400 invalid_json beyond)
  JSON schemas   (tool parameters, response_format, text.format, input_schema): at most
                 {MAX_SCHEMA_DEPTH} levels of objects/arrays in one schema and {MAX_SCHEMA_VALUES} JSON values over all
                 schemas of a request (400 schema_too_deep / schema_too_large)
  patterns       `pattern` / `patternProperties` at most {MAX_PATTERN_CHARS} characters; in a response
                 format they must be regular (no look-around, no backreferences: 400
                 unsupported_schema), as the grammar engine matches them in linear time
  stop strings   `stop` / Anthropic `stop_sequences`: at most {MAX_STOP_STRINGS} a request, each at most
                 {MAX_STOP_CHARS} characters (400 too_many_stop_sequences / stop_sequence_too_long)
  token budgets  max_tokens, max_completion_tokens, max_output_tokens (Anthropic max_tokens
                 is required): 0 or negative is a 400; absent means the rest of the context
                 (/v1/completions: 16)
  timeouts       --header-timeout, --body-timeout (408 and the connection closed),
                 --keep-alive-timeout (idle connections closed), --request-timeout (504)
  connections    --max-connections, --max-connections-per-client (429 beyond);
                 /health answers 503 "saturated" while every slot is taken"""


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve MODEL over an OpenAI- and Anthropic-compatible HTTP API. MODEL is a "
                                          "checkpoint directory,\na packed store, a .gguf file (imported once into the "
                                          "cache) or a Hugging Face repo id org/model\n(fetched into the Hugging Face "
                                          "cache; HF_HUB_OFFLINE=1: from that cache only); omitted: the\n"
                                          "embedded default model.",
                              epilog=_limits_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, packed store, .gguf file or Hugging Face repo id org/model "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face repo id MODEL (default: main)")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="defaults of the sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
                        "repetition_penalty): auto: the model's generation_config.json, neutral values where it "
                        "has none; vllm: the neutral values (temperature 1.0 as the OpenAI API, top_p 1, no top_k); "
                        "FOLDER: the generation_config.json there (default auto). Request values always win")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, local only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as `model` (default: MODEL's directory or file name; a Hugging Face "
                        "repo id as given)")
    p.add_argument("--api-key", default=env.API_KEY.get(),
                   help="require this key (Bearer or x-api-key); default $TIERMOE_API_KEY")
    add_sizing_args(p, max_num_seqs=16)
    add_cpu_threads_arg(p)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs (then 429)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--tensor-parallel-size", "--gpus", "-tp", type=int, default=1, metavar="N",
                   help="GPUs (processes) serving one packed store, each computing its share of every MoE layer's "
                        "experts (expert parallel; exact mode, the store path). This command starts the other "
                        "N-1 processes itself; under torchrun each process is one rank")
    add_store_args(p)
    add_routing_args(p)
    p.add_argument("--dtype", default="auto", help="activation dtype: auto, bfloat16, float16, float32")
    p.add_argument("--tool-call-parser", choices=("auto", "hermes", "glm"), default="auto",
                   help="tool-call format of the model's output (auto: from the model / chat template)")
    p.add_argument("--thinking-budget", type=int, default=None, help="default cap on reasoning tokens per request")
    p.add_argument("--allowed-origins", default="", help="comma-separated CORS origins (default: CORS off)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 beyond)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let running requests finish on SIGTERM")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="abort a generation running longer than this many seconds (504, or an in-stream error)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="concurrent API requests before 429 (default: --max-num-seqs + --max-queue + 32)")
    p.add_argument("--max-connections-per-client", type=int, default=None,
                   help="of those, how many one client address (IPv6: one /64) may hold (default: half of "
                        "--max-connections). A trusted proxy's X-Forwarded-For address counts as the client "
                        "(127.0.0.1, or $FORWARDED_ALLOW_IPS); behind another proxy set it to --max-connections")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (default 10; then 408 and closed)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's whole body may take to arrive after its headers (default 30; then 408 "
                        "and closed)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open between requests (default 5)")
    p.add_argument("--no-web", action="store_true",
                   help="do not serve the built-in web page (chat and live dashboard) at / (default: served; "
                        "with --api-key it asks for the key)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="least severe log lines printed (info: start-up, one line per request, throughput)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no access line per finished request (id, route, tokens, tok/s) in the log")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line (prompt and generation tokens/s, running and waiting "
                        "requests, KV cache use, expert slot hits and misses) while there is traffic")
    p.add_argument("--scripted", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scripted-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--scripted-tool-format", choices=("hermes", "glm"), default="hermes", help=argparse.SUPPRESS)
    p.set_defaults(handler=serve)


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.scripted:
        return "scripted"
    if args.model:
        if is_repo_id(args.model) and not Path(args.model).exists():
            return args.model  # as vLLM: a Hub model is served under its repo id
        return Path(args.model.rstrip("/")).name or args.model
    from tiermoe.default_model import MODEL_NAME

    return MODEL_NAME


def _check_args(args) -> None:
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a valid TCP port")
    check_sizing_args(args)
    if args.max_queue < 0:
        raise UserError("--max-queue must be >= 0")
    if args.thinking_budget is not None and args.thinking_budget < 0:
        raise UserError("--thinking-budget must be >= 0")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise UserError("--request-timeout must be > 0")
    if args.max_connections is not None and args.max_connections < 1:
        raise UserError("--max-connections must be at least 1")
    if args.max_connections_per_client is not None and args.max_connections_per_client < 1:
        raise UserError("--max-connections-per-client must be at least 1")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0")
    if not 0 < args.max_body_mb < math.inf:  # a byte count: inf has none (int() would fail after the load)
        raise UserError(f"--max-body-mb must be a finite number > 0, got {args.max_body_mb}")
    if not 0 <= args.drain_timeout < math.inf:  # uvicorn takes whole seconds: nan, inf have none
        raise UserError(f"--drain-timeout must be a finite number of seconds >= 0, got {args.drain_timeout}")
    if args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size {args.tensor_parallel_size}: must be >= 1")
    if args.model and not args.scripted:
        check_name(args.model)
    _check_blank(args)
    if args.generation_config not in SAMPLING_MODES and not Path(args.generation_config).expanduser().is_dir():
        raise UserError(f"--generation-config {args.generation_config}: not auto, vllm or an existing folder")


def _check_blank(args) -> None:
    """Empty text given on purpose (often an unset shell variable) would otherwise change meaning in silence:
    --api-key "" served with no key at all, --host "" failed as an unknown name, --generation-config "" read
    the working directory, --served-model-name "" fell back to the default name."""
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty; omit the flag (and $TIERMOE_API_KEY) to serve without a key")
    if not args.host.strip():
        raise UserError("--host is empty; give an address (0.0.0.0: every interface, 127.0.0.1: this machine)")
    if not args.generation_config.strip():
        raise UserError("--generation-config is empty; give auto, vllm or a folder")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name is empty; omit it for the default name")


def resolve(args) -> tuple[argparse.Namespace, SamplingDefaults]:
    """MODEL made a local directory (fetched from the Hub or imported from GGUF first, on this
    thread, with progress lines) and the sampling defaults read from it; the namespace returned
    names that directory, so the engine build finds it without resolving again."""
    if args.scripted:
        return args, load_sampling_defaults("vllm", None)
    model_dir = resolve_model(args.model, revision=args.revision)
    defaults = load_sampling_defaults(args.generation_config, model_dir)
    log.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
    model = None if args.model is None else str(model_dir)
    return argparse.Namespace(**{**vars(args), "model": model, "revision": None}), defaults


def _check_port(host: str, port: int) -> None:
    """Fail early with one line if the address cannot be bound (uvicorn would exit(1))."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def start_group(args):
    """For --tensor-parallel-size N > 1: the other ranks started (server/ranks.py) and this process joined as
    rank 0; None for one process."""
    if args.tensor_parallel_size == 1:
        return None
    from tiermoe.server.ranks import LeaderGroup

    return LeaderGroup.start(args)


def build_core(args):
    """The EngineCore for these arguments (the scripted one for --scripted)."""
    if args.scripted:
        from tiermoe.engine.scripted import ScriptedEngineCore

        return ScriptedEngineCore(max_model_len=args.max_model_len or 8192, max_num_seqs=args.max_num_seqs,
                                  step_delay_s=args.scripted_step_delay, tool_format=args.scripted_tool_format)
    try:
        from tiermoe.engine.build import build_engine_core
        from tiermoe.engine.settle import resolve_device
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("tiermoe"):
            raise UserError("this install has no model engine (tiermoe.engine.build); "
                            "use --scripted to test the server") from None
        raise
    options = {k: v for k, v in vars(args).items() if k not in ("handler", "api_key")}
    # on this thread: the engine thread, which will step the core
    use_cpu_threads(serving_threads(args.cpu_threads, resolve_device(args.device)))
    try:
        core = build_engine_core(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                 max_num_seqs=args.max_num_seqs, options=options)
        if core.runner.graphs is not None:  # compile and record now, not while the first requests wait
            steps = core.warm_up()
            log.info("warm-up: %d steps (prefill chunks, decode batch sizes 1-%d) in %.1f s", steps,
                     args.max_num_seqs, core.warm_up_done["seconds"])
        return core
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as exc:  # allocation, pinning, a missing or unreadable file: one line, exit 2
        log.debug("engine start-up failed", exc_info=True)
        raise UserError(startup_error(exc, args)) from None


def startup_error(exc: BaseException, args) -> str:
    """One line saying what failed while building the engine, and what to change."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    low = first.lower()
    if "pin" in low or "mlock" in low or "memlock" in low or "hostregister" in low or "hostalloc" in low:
        return (f"cannot pin (page-lock) host memory ({first}); raise the memlock limit (ulimit -l) "
                f"or lower --host-expert-gb")
    if isinstance(exc, (MemoryError, OverflowError)) or "allocate" in low or "out of memory" in low:
        return (f"cannot allocate memory while loading the model ({first}); lower --kv-cache-gb, --host-expert-gb, "
                f"--gpu-expert-gb or --max-model-len (pinned host memory is also bounded by `ulimit -l`)")
    if isinstance(exc, OSError):
        name = getattr(exc, "filename", None) or args.model
        return f"{name}: {exc.strerror or first}"
    return f"cannot start the engine for {args.model or 'the default model'}: {type(exc).__name__}: {first}"


def serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(REQUESTS_LOGGER).disabled = args.disable_log_requests
    logging.getLogger(STATS_LOGGER).disabled = args.disable_log_stats
    for noisy in ("httpx", "httpx2"):  # huggingface_hub's HTTP client logs every request at info
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    _check_args(args)
    _check_port(args.host, args.port)
    served_name = _served_name(args)
    args, sampling_defaults = resolve(args)
    if (not args.scripted and args.tensor_parallel_size > 1 and "WORLD_SIZE" in os.environ
            and os.environ.get("RANK", "0") != "0"):
        from tiermoe.server.ranks import follow_as_launched  # a rank torchrun started: follow rank 0

        return follow_as_launched(args)
    group = None if args.scripted else start_group(args)
    from tiermoe.engine.async_engine import AsyncEngine
    from tiermoe.engine.gc_pauses import freeze_startup_heap
    from tiermoe.server.app import create_app
    from tiermoe.server.connections import uvicorn_config

    # built on the thread that will step it (engine/async_engine.py: a core stepped from another
    # thread than the one that built it ran 3.3x slower per token on a CPU)
    try:
        engine = AsyncEngine.build_in_thread(lambda: build_core(args))
    except KeyboardInterrupt:
        # The building thread cannot be stopped inside CUDA calls or page-locking; tearing the
        # interpreter down around it can hang. Leave at once (the OS frees pinned memory).
        print("tiermoe: interrupted while loading the model", file=sys.stderr, flush=True)
        if group is not None:
            group.abandon()
        os._exit(130)
    except BaseException:
        if group is not None:
            group.abandon()
        raise
    app = create_app(
        engine,
        served_model_name=served_name,
        api_key=args.api_key or None,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        tool_format=None if args.tool_call_parser == "auto" else args.tool_call_parser,
        thinking_budget=args.thinking_budget,
        cors_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        drain_timeout_s=args.drain_timeout,
        request_timeout_s=args.request_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        aliases=["default"] if not args.model and not args.served_model_name else None,
        web=not args.no_web,
        sampling_defaults=sampling_defaults,
    )
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            graceful_timeout_s=max(1, int(args.drain_timeout)))
    # the loaded engine's objects out of every later full collection (engine/gc_pauses.py)
    log.info("start-up heap frozen: %d objects left out of garbage collections", freeze_startup_heap())
    server = _Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        asyncio.run(_run(server, f"http://{host}:{args.port}"))
    except OSError as exc:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    finally:
        engine.release()
        if group is not None:
            group.close(engine)
    if not server.started:
        raise UserError(f"server did not start on {args.host}:{args.port} (address in use?)")
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM after its graceful shutdown (exit status -15);
        here SIGTERM means "drain and stop", so the process exits 0 once drained."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.config.app.state.live_stats.stop()  # open dashboards' streams end now, not at the drain timeout
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return Server


def _Server(config):
    return _server_class()(config)


async def _run(server, url: str) -> None:
    """Serve until SIGINT/SIGTERM; uvicorn stops accepting, lets responses finish, then drains."""
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        log.info("listening on %s (OpenAI API at %s/v1)", url, url)
        print(f"tiermoe: listening on {url}", file=sys.stderr, flush=True)
    await task

