"""``kvlab serve``: an OpenAI-compatible HTTP server over one engine. Heavy imports (torch, the engine,
FastAPI) wait until the command runs, so ``kvlab --help`` stays fast."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from kvlab.cli.commands import KvlabCommand
from kvlab.cli.common import (
    AttentionBackendOption,
    DtypeOption,
    KvCacheDtypeOption,
    QuantizationOption,
    SpeculativeOption,
    ThreadsOption,
    WeightsSeedOption,
    check_engine_mode,
    fail,
    list_items,
    load_or_exit,
    set_threads,
    strategy_option,
)
from kvlab.config import CacheConfig, ConfigError, Eviction, SchedulerConfig
from kvlab.experiment.strategies import BuiltinStrategy
from kvlab.server.tenancy import CachedTokensReport, PrefixSharing

log = logging.getLogger("kvlab.server")


class ServeCommand(KvlabCommand):
    """``kvlab serve``: ``--api-key k1 k2`` gives two keys, as vllm serve's argparse does (the model then comes
    first, ``kvlab serve MODEL --api-key k1 k2``, or by ``--model``)."""

    nargs_plus = ("--api-key",)


def serve_cli(
    model_arg: Annotated[
        str | None, typer.Argument(metavar="MODEL", help="mini | mini-gqa | mini-mqa | smollm2 | PATH (as vllm serve)")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="The same as MODEL (kept for old scripts)")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = any free port)")] = 8000,
    served_model_name: Annotated[str | None, typer.Option(help="Model name clients must send")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block")] = CacheConfig.block_size,
    num_blocks: Annotated[
        int, typer.Option(min=1, help="KV blocks in the pool (its size: num_blocks x block_size tokens)")
    ] = CacheConfig.num_blocks,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Prefix caching (vLLM's flag)"),
    ] = CacheConfig.share_prefix,
    # kvlab's older name, kept for scripts and out of --help: two long aliases cut the help's flag column.
    share_prefix: Annotated[bool | None, typer.Option("--share-prefix/--no-share-prefix", hidden=True)] = None,
    dtype: DtypeOption = "auto",
    weights_seed: WeightsSeedOption = 0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the sampling of requests without a seed of their own: one stream, as vllm serve's "
            "--seed, so their draws depend on each other's (default: a stream of its own per request)"
        ),
    ] = None,
    quantization: QuantizationOption = None,
    attention_backend: AttentionBackendOption = "reference",
    kv_cache_dtype: KvCacheDtypeOption = "auto",
    speculative_config: SpeculativeOption = None,
    max_num_seqs: Annotated[
        int, typer.Option(min=1, help="Sequences in the running batch (seats)")
    ] = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens one step may compute (prompt chunks and decodes together)")
    ] = SchedulerConfig.max_num_batched_tokens,
    max_model_len: Annotated[int | None, typer.Option(min=1, help="Default: min(model, pool)")] = None,
    max_pending: Annotated[int, typer.Option(min=1, help="Requests in flight before answering 429")] = 256,
    max_request_seqs: Annotated[
        int | None,
        typer.Option(min=1, help="Sequences (prompts x n) one request may ask for, else 400 (default: max-num-seqs)"),
    ] = None,
    max_tenant_seqs: Annotated[
        int | None,
        typer.Option(
            min=1, help="Sequences one tenant (API key) may have in flight, else 429 (default: 4 x max-num-seqs)"
        ),
    ] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST[:PORT],...",
            help="Host headers a client may use besides the bind address and localhost ('*': any, only behind a "
            "proxy that checks it); others are refused (DNS rebinding)",
        ),
    ] = None,
    read_timeout: Annotated[
        float, typer.Option(min=0.001, help="Seconds a client has to send a request's headers, then its body")
    ] = 30.0,
    shutdown_grace: Annotated[
        float,
        typer.Option(min=0, help="On SIGTERM, seconds requests in flight get to finish before each ends with a 503"),
    ] = 5.0,
    unsafe_strategy: Annotated[
        BuiltinStrategy | None, strategy_option("Run with an experiment strategy, for testing probes")
    ] = None,
    threads: ThreadsOption = None,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every request (uvicorn's access log)")] = False,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY[:TENANT]...",
            help="Keys a client must send as 'Authorization: Bearer KEY', several after one flag (as vllm serve) "
            "or the flag repeated",
        ),
    ] = None,
    api_keys_file: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="File of 'KEY [TENANT]' lines")
    ] = None,
    prefix_sharing: Annotated[PrefixSharing, typer.Option(help="Who shares prefix-cache entries")] = "per-tenant",
    report_cached_tokens: Annotated[
        CachedTokensReport, typer.Option(help="usage cached_tokens (block: whole blocks only)")
    ] = "block",
    trust_salt_header: Annotated[
        bool, typer.Option("--trust-salt-header", help="Honour X-Cache-Salt (only behind a proxy that sets it)")
    ] = False,
    public_prefix_file: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="YAML or JSONL of texts or chat messages shared across tenants: a prompt starting with one has "
            "its full KV blocks keyed without the tenant's salt (the rest stays private)",
        ),
    ] = None,
    eviction: Annotated[
        Eviction | None,
        typer.Option(
            help="Which cached block goes first when the pool is full: lru, or fair (the oldest of the tenant "
            "holding the most cached blocks, so one tenant's flood evicts its own). Default: fair with API keys, "
            "lru without (one tenant: the same order)",
        ),
    ] = None,
    promote_after: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="Make a prompt prefix public once K distinct tenants (API keys' tenants; a tenant's cache_salts "
            "are one) computed it. Opt-in: whoever holds K-1 keys can test whether another tenant sent a guessed "
            "prefix; fewer keys learn nothing (docs/serving.md, 'What is shared with whom')",
        ),
    ] = None,
    metrics_api_key: Annotated[
        str | None,
        typer.Option(
            help="Serve /metrics only to 'Authorization: Bearer KEY' (a key of its own: tenant keys never open it, "
            "it opens nothing else)"
        ),
    ] = None,
    public_metrics: Annotated[
        bool,
        typer.Option(
            "--public-metrics",
            help="Serve /metrics to anyone, even where it reveals more than responses do (cache hits hidden by "
            "--report-cached-tokens, other tenants' traffic). Default: open only where it reveals nothing more",
        ),
    ] = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    try:
        from kvlab.server.serve import ServerConfig, build_app, listen, serve_until_stopped, url
        from kvlab.server.tenancy import TenancyConfigError, TenancyPolicy, parse_api_keys
    except ModuleNotFoundError as exc:  # FastAPI and uvicorn come with the serve extra
        fail(f"{exc}; install it with: pip install 'kvlab[serve]'")

    if model_arg is not None and model is not None and model_arg != model:
        fail(f"two models given: {model_arg!r} and --model {model!r}")
    name = model_arg or model or "mini"
    check_engine_mode(quantization, attention_backend)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sched: dict[str, Any] = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    if max_model_len is not None:
        sched["max_model_len"] = max_model_len
    if speculative_config is not None:
        sched["speculative"] = speculative_config
    try:
        keys = parse_api_keys(api_key or [], api_keys_file)
        # Every tenancy setting checked before the model loads (the server builds the real policy).
        TenancyPolicy(
            keys, prefix_sharing, report_cached_tokens, metrics_api_key=metrics_api_key, public_metrics=public_metrics
        )
    except (TenancyConfigError, OSError) as exc:
        fail(str(exc))
    cfg = ServerConfig(
        api_keys=keys,
        prefix_sharing=prefix_sharing,
        report_cached_tokens=report_cached_tokens,
        trust_salt_header=trust_salt_header,
        metrics_api_key=metrics_api_key,
        public_metrics=public_metrics,
        public_prefix_file=public_prefix_file,
        model=name,
        weights_seed=weights_seed,
        seed=seed,
        host=host,
        port=port,
        served_model_name=served_model_name or name,
        max_pending=max_pending,
        max_request_seqs=max_request_seqs,
        max_tenant_seqs=max_tenant_seqs,
        allowed_hosts=tuple(h for value in allowed_host or () for h in list_items(value)),
        read_timeout=read_timeout,
        shutdown_grace=shutdown_grace,
        unsafe_strategy=unsafe_strategy,
        quantization=quantization,
        attention_backend=attention_backend,
        cache={
            "block_size": block_size,
            "num_blocks": num_blocks,
            "share_prefix": enable_prefix_caching if share_prefix is None else share_prefix,
            "kv_cache_dtype": kv_cache_dtype,
            "promote_after": promote_after,
            **({"eviction": eviction} if eviction is not None else {}),
        },
        scheduler=sched,
    )
    loaded = load_or_exit(name, weights_seed=weights_seed, dtype=dtype)
    set_threads(threads, loaded)
    try:
        app = build_app(cfg, loaded)
        sock = listen(host, port)
    except (ConfigError, TypeError, ValueError, OSError) as exc:
        fail(str(exc))
    if unsafe_strategy:
        log.warning("UNSAFE: serving with strategy %r; requests may leak into each other", unsafe_strategy)
    log.info("serving %s on %s", cfg.served_model_name, url(host, sock.getsockname()[1]))
    # uvicorn handles Ctrl-C and SIGTERM: in-flight requests get a moment to finish, then the engine stops.
    # It raises the signal again once done, so Ctrl-C ends as a KeyboardInterrupt here.
    status = 0
    with contextlib.suppress(KeyboardInterrupt):
        status = serve_until_stopped(app, sock, access_log=access_log)
    if status:
        raise typer.Exit(status)
