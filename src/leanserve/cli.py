"""Command line: ``leanserve generate | chat | serve | router | bench``."""

from __future__ import annotations

import argparse
import sys

from .engine.config import ATTENTION_BACKENDS, BACKENDS
from .model.config import ModelLoadError
from .model.quant import QUANTIZATIONS
from .router.config import POLICIES
from .server.tool_calls import TOOL_CALL_PARSERS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="int8: int8 weight copies for steps of a few rows (faster small-batch decode); gguf: a "
                        "GGUF file's Q4_0/Q4_1 layers computed on their 4-bit blocks (batch-1 decode ~2x faster, "
                        "prefill ~5x slower; bf16 only)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens of a step in which some request decodes (decode rows + prefill chunks); default on "
                        "CPU: --max-num-seqs + 128 (192), + 320 (384) where bf16 linear layers run on AMX; 2048 on a "
                        "GPU")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="tokens of a step in which no request decodes; default: --max-num-batched-tokens where "
                        "given, else on CPU 2048 (or --max-num-batched-tokens where more), elsewhere "
                        "--max-num-batched-tokens")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens a KV cache block holds; default: 32 on CPU, 16 on a GPU")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, help="bytes, e.g. 512M or 2G")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs / top_logprobs a request may ask for")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention: cpu-paged, leanserve's CPU kernels for decode rows and prefill chunks, "
                        "reading KV blocks in place (built with the machine's C++ compiler on first use); sdpa, "
                        "keys gathered then SDPA (every other device); auto (default): each kernel where it "
                        "applies and builds, else sdpa")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that hold one model between them (attention heads, KV heads and MLP columns split; "
                        "on CPU each gets cores / N threads)")
    p.add_argument("--distributed-executor-backend", default="mp", choices=BACKENDS,
                   help="how the tensor-parallel ranks start: mp, processes on this machine; ray, actors on the "
                        "Ray cluster this machine has joined (pip install 'leanserve[ray]'; ray start ...)")


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _engine_config(a):
    from .engine.config import EngineConfig

    return EngineConfig(model=a.model, dtype=a.dtype, device=a.device, quantization=a.quantization,
                        max_model_len=a.max_model_len,
                        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        max_prefill_tokens=a.max_prefill_tokens,
                        block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
                        enable_prefix_caching=a.enable_prefix_caching, seed=a.seed, max_logprobs=a.max_logprobs,
                        attention_backend=a.attention_backend, tensor_parallel_size=a.tensor_parallel_size,
                        distributed_executor_backend=a.distributed_executor_backend)


def _sampling(a):
    from .engine.params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)


def _add_sampling(p):
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)


def _llm(a):
    from .llm import LLM

    cfg = _engine_config(a)
    return LLM(cfg.model, **{k: v for k, v in vars(cfg).items() if k != "model"})


def cmd_generate(a) -> None:
    with _llm(a) as llm:
        for delta in llm.stream(a.prompt, _sampling(a)):
            print(delta.text, end="", flush=True)
        print()


def cmd_chat(a) -> None:
    with _llm(a) as llm:
        messages = [{"role": "system", "content": a.system}] if a.system else []
        print("leanserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = []
            for delta in llm.stream(llm.chat_prompt(messages), _sampling(a)):
                reply.append(delta.text)
                print(delta.text, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(a) -> None:
    from .server.app import ServerConfig
    from .server.launcher import serve

    engine = _engine_config(a)
    if a.kv_transfer_config is not None:
        from .engine.kv_transfer.config import KVTransferConfig

        engine.kv_transfer = KVTransferConfig.from_json(a.kv_transfer_config).with_engine_id()
    # serve checks the flags before any process starts: a bad one is a line from main().
    serve(ServerConfig(engine=engine, host=a.host, port=a.port, served_model_name=a.served_model_name,
                       api_key=a.api_key, max_waiting_requests=a.max_waiting_requests,
                       max_request_body_bytes=a.max_request_body_bytes, shutdown_timeout=a.shutdown_timeout,
                       watchdog_timeout=a.watchdog_timeout, data_parallel_size=a.data_parallel_size,
                       api_server_count=a.api_server_count, enable_auto_tool_choice=a.enable_auto_tool_choice,
                       tool_call_parser=a.tool_call_parser, chat_template=a.chat_template,
                       generation_config=a.generation_config))


def cmd_router(a) -> None:
    from .router.app import serve
    from .router.config import RouterConfig

    # A bad combination of flags is a ValueError from RouterConfig.validate: one line, from main().
    serve(RouterConfig(host=a.host, port=a.port, backends=tuple(a.backend or ()), prefill=tuple(a.prefill or ()),
                       decode=tuple(a.decode or ()), policy=a.policy, health_interval_s=a.health_interval))


def cmd_bench(a) -> None:
    from .bench import disagg, host, serve, soak

    {"host": host.main, "serve": serve.main, "soak": soak.main, "disagg": disagg.main}[a.bench_command](a.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanserve")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming the text")
    g.add_argument("prompt")
    _engine_args(g)
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _engine_args(c)
    _add_sampling(c)
    c.add_argument("--system", default=None)
    c.set_defaults(func=cmd_chat, max_tokens=512)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences in flight (running + queued) per engine and API process past which new "
                        "requests get 503")
    s.add_argument("--max-request-body-bytes", type=_bytes, default=4 << 20,
                   help="larger request bodies get 413 (default 4M)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    s.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="seconds without engine progress (one iteration, or no heartbeat) before /health "
                        "answers 503 and the engine logs its loop's stack")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core processes, each with its own model copy and KV cache; requests go to the "
                        "least loaded (on CPU each gets cores / N threads)")
    s.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API processes sharing the port (HTTP, tokenization, detokenization), all in front of "
                        "the same engines")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model decides, its tool calls are '
                        "parsed with --tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="hermes: <tool_call>{...}</tool_call> (Qwen2/Qwen3, Hermes and others)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, as a file or inline, in place of the checkpoint's")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                        "from a generation_config.json: auto (the model's), leanserve (none) or a directory; "
                        "request fields override them")
    s.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='disaggregated serving, vLLM\'s fields: \'{"kv_connector":"ZmqConnector","kv_role":"kv_both",'
                        '"kv_port":5600}\' (kv_role: kv_producer, kv_consumer or kv_both; also kv_ip, '
                        'kv_transfer_timeout_s, kv_lease_timeout_s, kv_load_failure_policy)')
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("router", help="OpenAI-compatible proxy: load-balances replicas (--backend) or runs "
                                      "disaggregated prefill/decode (--prefill, --decode)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    roles = r.add_mutually_exclusive_group(required=True)
    roles.add_argument("--backend", nargs="+", metavar="URL", help="aggregated replicas, e.g. http://127.0.0.1:8001")
    roles.add_argument("--prefill", nargs="+", metavar="URL", help="prefill workers (with --decode)")
    r.add_argument("--decode", nargs="+", metavar="URL", help="decode workers (with --prefill)")
    r.add_argument("--policy", default="round_robin", choices=POLICIES,
                   help="least_loaded: fewest requests in flight through this router, ties round robin")
    r.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often each backend's /health is polled (a failing one leaves rotation until it answers)")
    r.set_defaults(func=cmd_router)

    b = sub.add_parser("bench", help="benchmarks: `host` (executor host path), `serve` (load generator), "
                                     "`soak` (reliability under a mixed workload) or `disagg` (a decode worker's "
                                     "host path while long prompts' KV arrives)")
    b.add_argument("bench_command", choices=["host", "serve", "soak", "disagg"])
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ModelLoadError, ValueError) as e:
        # Bad input from the user: one line, no traceback.
        print(f"leanserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
